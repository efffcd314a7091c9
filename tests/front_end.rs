//! Front-end tests driven by `specs/`: every example checks clean; every bad spec in
//! `specs/invalid/` reports the diagnostics its `# expect: CODE LINE:COL` header names, at
//! exactly that position, and its rendered report is a golden snapshot.

use std::path::{Path, PathBuf};

use pipec_grammar::diagnostic::render_human;
use pipec_grammar::{check_source_in, LineIndex};

fn spec_files(dir: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[test]
fn every_example_spec_checks_clean() {
    let files = spec_files("specs");
    assert!(files.len() >= 10, "expected at least 10 example specs, found {}", files.len());
    for path in files {
        let src = read(&path);
        let result = check_source_in(&src, path.parent());
        let rendered = render_human(&path.display().to_string(), &src, &result.diagnostics, false);
        assert!(!result.has_errors(), "{} has errors:\n{rendered}", path.display());
        assert!(result.spec.is_some(), "{} produced no spec", path.display());
    }
}

#[test]
fn every_spec_file_names_the_schema() {
    for path in spec_files("specs").into_iter().chain(spec_files("specs/invalid")) {
        let first = read(&path).lines().next().unwrap_or_default().to_string();
        assert!(
            first.starts_with("# yaml-language-server: $schema="),
            "{} must start with the schema comment",
            path.display()
        );
    }
}

/// The `# expect: CODE LINE:COL` lines of a bad spec.
fn expectations(src: &str) -> Vec<(String, usize, usize)> {
    src.lines()
        .filter_map(|l| l.strip_prefix("# expect: "))
        .map(|rest| {
            let (code, pos) = rest.split_once(' ').expect("`# expect: CODE LINE:COL`");
            let (line, col) = pos.trim().split_once(':').expect("LINE:COL");
            (code.to_string(), line.parse().expect("line"), col.parse().expect("column"))
        })
        .collect()
}

#[test]
fn every_invalid_spec_reports_its_expected_diagnostics_at_the_right_place() {
    let files = spec_files("specs/invalid");
    assert!(files.len() >= 30, "expected at least 30 invalid specs, found {}", files.len());
    for path in files {
        let src = read(&path);
        let expected = expectations(&src);
        assert!(!expected.is_empty(), "{} has no `# expect:` line", path.display());
        let result = check_source_in(&src, path.parent());
        assert!(result.has_errors(), "{} should have errors", path.display());
        let index = LineIndex::new(&src);
        let got: Vec<(String, usize, usize)> = result
            .diagnostics
            .iter()
            .map(|d| {
                let lc = index.line_col(&src, d.span().start);
                (d.code.to_string(), lc.line, lc.column)
            })
            .collect();
        for e in &expected {
            assert!(got.contains(e), "{}: expected {} at {}:{}, got {:?}", path.display(), e.0, e.1, e.2, got);
        }
        for d in &result.diagnostics {
            assert!(pipec_grammar::codes::lookup(d.code).is_some(), "unregistered code {}", d.code);
        }
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("spec").to_string();
        let rendered = render_human(&format!("specs/invalid/{name}.yaml"), &src, &result.diagnostics, false);
        insta::assert_snapshot!(format!("invalid__{name}"), rendered);
    }
}

#[test]
fn committed_schema_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("schema/pipec.schema.json");
    let committed = read(&path);
    assert_eq!(
        committed,
        pipec_grammar::schema::json_schema_text(),
        "schema/pipec.schema.json is stale: run `pipec schema > schema/pipec.schema.json`"
    );
}

#[test]
fn microbatch_fixes_meet_every_constraint_at_once() {
    // (layout, schedule, microbatches, batch size) → the fix offered, if any value works
    let base = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/invalid/microbatches-vs-batch.yaml"));
    let cases: &[(&str, &str, usize, usize, Option<&str>)] = &[
        ("\"1-1\"", "1f1b", 5, 64, Some("4")),
        // must divide 48 and be a multiple of 3 replicas: 3 and 6 are equally near 5 → 6
        ("\"3-3\"", "1f1b", 5, 48, Some("6")),
        // 3 replicas never divide a batch of 64
        ("\"3-3\"", "1f1b", 4, 64, None),
        // interleaved over 2 stages, batch 24: multiples of 2 dividing 24 → 6 is nearest to 5
        ("\"1-1\"", "{ kind: interleaved, virtual_stages: 2 }", 5, 24, Some("6")),
        // chimera on 2 pairs: a multiple of 4 dividing 48 → 4 and 8 tie for 6 → 8
        ("\"2-2\"", "chimera", 6, 48, Some("8")),
    ];
    for &(layout, schedule, mb, batch, want) in cases {
        let src = base
            .replace("stages: \"1-1\"", &format!("stages: {layout}"))
            .replace("schedule: 1f1b", &format!("schedule: {schedule}"))
            .replace("microbatches: 5", &format!("microbatches: {mb}"))
            .replace("batch_size: 64", &format!("batch_size: {batch}"))
            .replace("devices_per_node: 2", "devices_per_node: 6");
        let result = pipec_grammar::check_source(&src);
        let errors: Vec<_> = result.diagnostics.iter().filter(|d| d.code == "E0404" || d.code == "E0405").collect();
        assert!(
            !errors.is_empty(),
            "{layout} {schedule} {mb}/{batch}: no microbatch diagnostic: {:?}",
            result.diagnostics
        );
        for d in errors {
            let got = d.fix.as_ref().map(|f| {
                assert_eq!(&src[f.span.start..f.span.end], mb.to_string(), "the fix rewrites the microbatches value");
                f.replacement.as_str()
            });
            assert_eq!(got, want, "{layout} {schedule} {mb}/{batch}: {}", d.message);
        }
    }
}

#[test]
fn huge_numbers_get_diagnostics_not_overflows_or_endless_work() {
    let base = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/invalid/microbatches-vs-batch.yaml"));
    let check = |from: &[(&str, &str)]| {
        let mut src = base.clone();
        for (a, b) in from {
            assert!(src.contains(a), "{a}");
            src = src.replace(a, b);
        }
        pipec_grammar::check_source(&src).diagnostics
    };
    // a prime batch size near 10^12: its divisors are found in pairs up to the square root
    let d = check(&[("batch_size: 64", "batch_size: 999999999989")]);
    let e = d.iter().find(|d| d.code == "E0404").expect("E0404");
    assert!(e.help.as_deref().is_some_and(|h| h.ends_with(": 1, 999999999989")), "{e:?}");
    assert_eq!(e.fix.as_ref().map(|f| f.replacement.as_str()), Some("1"));
    // a prime batch size near 2^63: too many candidates to search, so no fix, but a diagnostic
    let d = check(&[("batch_size: 64", "batch_size: 9223372036854775783")]);
    assert!(d.iter().any(|d| d.code == "E0404" && d.fix.is_none()), "{d:?}");
    // nodes × devices overflowing usize
    let d = check(&[("nodes: 1", "nodes: 4294967296"), ("devices_per_node: 2", "devices_per_node: 4294967296")]);
    assert!(d.iter().any(|d| d.code == "E0105" && d.message.contains("devices")), "{d:?}");
    // more (stage, microbatch) pairs than pipec plans
    let d =
        check(&[("microbatches: 5", "microbatches: 1099511627776"), ("batch_size: 64", "batch_size: 1099511627776")]);
    assert!(d.iter().any(|d| d.code == "E0105" && d.message.contains("forward passes per step")), "{d:?}");
}

#[test]
fn a_strategy_cluster_mismatch_offers_the_matching_cluster_size() {
    let src = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/invalid/strategy-vs-cluster.yaml"));
    let d = pipec_grammar::check_source(&src).diagnostics;
    let e = d.iter().find(|d| d.code == "E0402").expect("E0402");
    let fix = e.fix.as_ref().expect("a fix");
    assert_eq!(
        (fix.title.as_str(), fix.replacement.as_str(), &src[fix.span.start..fix.span.end]),
        ("use 4 devices per node", "4", "2")
    );
    // applied, the spec checks clean
    let fixed = format!("{}{}{}", &src[..fix.span.start], fix.replacement, &src[fix.span.end..]);
    assert!(!pipec_grammar::check_source(&fixed).has_errors());
    // with 3 nodes, 4 devices cannot be spread evenly: no fix, the help still says what to do
    let three = src.replace("  nodes: 1\n", "  nodes: 3\n").replace(
        "    intra_node: { bandwidth: 10GB/s, latency: 5us }\n",
        "    intra_node: { bandwidth: 10GB/s, latency: 5us }\n    inter_node: { bandwidth: 10GB/s, latency: 5us }\n",
    );
    let d = pipec_grammar::check_source(&three).diagnostics;
    let e = d.iter().find(|d| d.code == "E0402").expect("E0402");
    assert!(e.fix.is_none() && e.help.is_some(), "{e:?}");
}

fn model_of(path: &str) -> pipec_grammar::spec::Model {
    let src = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join(path));
    let result = check_source_in(&src, Path::new(path).parent());
    assert!(!result.has_errors(), "{path}: {:?}", result.diagnostics);
    result.spec.expect("checks").model
}

#[test]
fn resnet50_has_torchvisions_parameter_count() {
    // torchvision.models.resnet50(): sum(p.numel() for p in model.parameters())
    let model = model_of("specs/resnet50.yaml");
    let params: u64 = model.layers.iter().map(|l| l.op.parameter_count()).sum();
    assert_eq!(params, 25_557_032);
    // 53 convolutions (49 in the bottlenecks and the stem, 4 projections), 53 batch norms,
    // 16 residual additions, one classifier
    let count = |name: &str| model.layers.iter().filter(|l| l.op.name() == name).count();
    assert_eq!((count("conv2d"), count("batchnorm2d"), count("add"), count("linear")), (53, 53, 16, 1));
    assert_eq!(model.output_shape(), &[1000]);
    // a labelled block call names the range of layers it expanded into
    let res3 = model.groups.iter().find(|g| g.label == "res3").expect("res3");
    assert_eq!(model.layers[res3.first].op.name(), "conv2d");
    assert_eq!(model.layers[res3.last].op.name(), "relu");
    assert_eq!(model.layers[res3.last].output_shape, vec![512, 28, 28]);
    assert_eq!(model.layers[res3.last - 1].op.name(), "add");
}

#[test]
fn gpt2_small_has_hugging_faces_parameter_count() {
    // transformers.GPT2LMHeadModel(GPT2Config()).num_parameters(): the output layer shares
    // the token embedding, so it adds no parameters
    let model = model_of("specs/gpt2.yaml");
    assert_eq!(model.parameter_count(), 124_439_808);
    let untied: u64 = model.layers.iter().map(|l| l.op.parameter_count()).sum();
    assert_eq!(untied - model.parameter_count(), 50257 * 768);
    assert_eq!(model.output_shape(), &[1024, 50257]);
}

#[test]
fn mixtral_8x7b_has_its_published_parameter_count_and_active_parameters() {
    // Hugging Face's Mixtral-8x7B-v0.1 (MixtralForCausalLM(config).num_parameters()):
    // per block attention 4096·(4096 + 2·1024) + 4096², the router 4096·8, eight SwiGLU
    // experts of 3·4096·14336, two RMSNorms; 32 blocks, untied embedding and output layer
    // of 32000·4096, the final norm
    let model = model_of("bench/specs/mixtral-8x7b.yaml");
    assert_eq!(model.parameters(), 46_702_792_704);
    let block: u64 = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 8 + 2 * 4096;
    let expert: u64 = 3 * 4096 * 14336;
    assert_eq!(model.parameters(), 32 * (block + 8 * expert) + 2 * 32000 * 4096 + 4096);
    // two experts per token: the 12.9B Mistral AI's announcement gives
    let active = pipec_plan::model::active_parameters(model.layers.iter().map(|l| (&l.op, l.tied)));
    assert_eq!(active, Some(32 * (block + 2 * expert) + 2 * 32000 * 4096 + 4096));
    assert_eq!(active, Some(12_879_925_248));
    assert_eq!(model.parameters_text(), "46,702,792,704 parameters (12,879,925,248 active per token)");
    // a dense model says nothing of active parameters
    assert_eq!(model_of("specs/gpt2.yaml").parameters_text(), "124,439,808 parameters");
}

#[test]
fn inception_modules_concatenate_their_branches() {
    // GoogLeNet's stem, 3a, 3b and 4a: torchvision's counts for these layers (convolutions
    // with bias, no batch norm) plus a 512 -> 1000 classifier
    let model = model_of("specs/inception.yaml");
    let concats: Vec<&pipec_grammar::spec::Layer> = model.layers.iter().filter(|l| l.op.name() == "concat").collect();
    assert_eq!(concats.len(), 3);
    assert_eq!(concats[0].output_shape, vec![256, 28, 28]);
    assert_eq!(concats[1].output_shape, vec![480, 28, 28]);
    assert_eq!(concats[2].output_shape, vec![512, 14, 14]);
    assert!(concats.iter().all(|c| c.inputs.len() == 4));
    // every branch reads the module's input
    let first = model.groups.iter().find(|g| g.label == "i3a").expect("i3a");
    let module_input = pipec_plan::model::Source::Layer(first.first - 1);
    let readers = model.layers[first.first..=first.last].iter().filter(|l| l.inputs.contains(&module_input)).count();
    assert_eq!(readers, 4);
}

#[test]
fn a_mixture_of_experts_setting_on_a_block_without_experts_is_warned_once_at_its_argument() {
    let src = "name: g\nmodel:\n  input: [16]\n  layers:\n    - embedding(50, 32)\n    - repeat 3: transformer_block(d=32, heads=4, ff=64, causal=true, top_k=2, capacity=1.25, route_scale=2.5)\n    - linear(32, 50)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { kind: cpu, memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 1us }\nstrategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 1\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
    let result = check_source_in(src, None);
    assert!(!result.has_errors(), "{:?}", result.diagnostics);
    let warned: Vec<(&str, &str)> = result
        .diagnostics
        .iter()
        .filter(|d| d.code == "W0314")
        .map(|d| (d.message.as_str(), &src[d.span().start..d.span().end]))
        .collect();
    // once per argument, not once per repeated block
    assert_eq!(
        warned,
        vec![
            ("`top_k` applies only to a mixture of experts, and this block has none", "2"),
            ("`capacity` applies only to a mixture of experts, and this block has none", "1.25"),
            ("`route_scale` applies only to a mixture of experts, and this block has none", "2.5"),
        ]
    );
    // with experts, the same arguments are the mixture's and nothing is warned
    let moe = src.replace("top_k=2", "experts=4, top_k=2");
    assert!(check_source_in(&moe, None).diagnostics.iter().all(|d| d.code != "W0314"));
    // multi-head latent attention's sizes without its latent, likewise
    let mla = moe.replace("causal=true", "causal=true, rope_dim=4, v_head_dim=8, rope_mscale_all_dim=1");
    let warned: Vec<String> = check_source_in(&mla, None)
        .diagnostics
        .iter()
        .filter(|d| d.code == "W0314")
        .map(|d| d.message.clone())
        .collect();
    assert_eq!(
        warned,
        vec![
            "`rope_dim` applies only to multi-head latent attention, and this block has none",
            "`v_head_dim` applies only to multi-head latent attention, and this block has none",
            "`rope_mscale_all_dim` applies only to multi-head latent attention, and this block has none"
        ]
    );
    let latent = mla.replace("rope_dim=4", "kv_lora=16, rope_dim=4");
    assert!(check_source_in(&latent, None).diagnostics.iter().all(|d| d.code != "W0314"));
}

#[test]
fn an_unused_branch_is_a_warning_and_blocks_are_scoped() {
    let src = "name: g\nmodel:\n  input: [8]\n  blocks:\n    res(n):\n      - linear(n, n) -> relu as h\n      - add(h, in)\n  layers:\n    - linear(8, 8) as x\n    - x -> linear(8, 4) as unused\n    - x -> res(8) -> res(8)\n    - linear(8, 3)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { kind: cpu, memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 1us }\nstrategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 1\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
    let result = check_source_in(src, None);
    assert!(!result.has_errors(), "{:?}", result.diagnostics);
    let warnings: Vec<&str> =
        result.diagnostics.iter().filter(|d| d.code == "W0311").map(|d| d.message.as_str()).collect();
    assert_eq!(warnings, vec!["`unused` is never used"]);
    let model = result.spec.expect("checks").model;
    // x, unused, two blocks of (linear, relu, add), the head: the blocks' `h` stays local
    assert_eq!(model.layers.len(), 9);
    assert_eq!(model.layers[4].inputs, vec![pipec_plan::model::Source::Layer(3), pipec_plan::model::Source::Layer(0)]);
    assert!(model.layers.iter().all(|l| l.label.as_deref() != Some("h")));
}

#[test]
fn a_tensor_name_in_the_middle_of_a_chain_is_misplaced() {
    let src = "name: g\nmodel:\n  input: [8]\n  layers:\n    - linear(8, 8) as x\n    - linear(8, 8) -> x -> linear(8, 3)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { kind: cpu, memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 1us }\nstrategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 1\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
    let result = check_source_in(src, None);
    let codes: Vec<(&str, &str)> = result.diagnostics.iter().map(|d| (d.code, d.message.as_str())).collect();
    assert_eq!(codes, vec![("E0308", "the tensor `x` can only start a chain: `- x -> ...`")]);
    // an unknown bare name there is an unknown layer, with a suggestion
    let result = check_source_in(&src.replace("-> x ->", "-> relx ->"), None);
    assert_eq!(result.diagnostics[0].code, "E0302");
    assert_eq!(result.diagnostics[0].help.as_deref(), Some("did you mean `relu`?"));
}

#[test]
fn an_inter_node_bandwidth_past_one_devices_adapter_is_warned_with_each_devices_share() {
    // DGX H100's network, 8 × 400 Gb/s, written as the node's total
    let src = "name: g\nmodel:\n  input: [64]\n  layers:\n    - linear(64, 128) -> relu\n    - linear(128, 10)\n  loss: cross_entropy\ncluster:\n  nodes: 2\n  devices_per_node: 8\n  device: h100-sxm\n  links:\n    intra_node: { bandwidth: 450GB/s, latency: 3us }\n    inter_node: { bandwidth: 3200Gbps, latency: 6us }\nstrategy:\n  dp: 16\n  schedule: dp-only\n  microbatches: 16\ntraining:\n  batch_size: 64\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
    let result = check_source_in(src, None);
    assert!(!result.has_errors(), "{:?}", result.diagnostics);
    let rendered = render_human("node-total.yaml", src, &result.diagnostics, false);
    insta::assert_snapshot!("inter_node_bandwidth_of_a_node", rendered);
    // a device's own share, and the fastest adapter's, are not warned about
    for share in ["400Gbps", "800Gbps"] {
        let fine = src.replace("3200Gbps", share);
        assert!(check_source_in(&fine, None).diagnostics.iter().all(|d| d.code != "W0106"), "{share}");
    }
}

#[test]
fn a_recompute_module_no_block_has_is_warned_at_its_name() {
    let src = "name: g\nmodel:\n  input: [16]\n  layers:\n    - embedding(50, 32)\n    - repeat 2: transformer_block(d=32, heads=4, ff=64, causal=true)\n    - linear(32, 50)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { kind: cpu, memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 1us }\nstrategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 1\n  recompute: { modules: [core_attn, moe_act, mla_up_proj] }\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
    let result = check_source_in(src, None);
    assert!(!result.has_errors(), "{:?}", result.diagnostics);
    let warned: Vec<(&str, &str)> = result
        .diagnostics
        .iter()
        .filter(|d| d.code == "W0426")
        .map(|d| (d.message.as_str(), &src[d.span().start..d.span().end]))
        .collect();
    assert_eq!(
        warned,
        vec![
            ("`moe_act` recomputes nothing in this model: no block is a mixture of experts", "moe_act"),
            ("`mla_up_proj` recomputes nothing in this model: no block has multi-head latent attention", "mla_up_proj"),
        ]
    );
    // on a mixture of experts the same module is the experts' activation
    let moe = src.replace("causal=true", "causal=true, experts=4").replace(", mla_up_proj", "");
    assert!(check_source_in(&moe, None).diagnostics.iter().all(|d| d.code != "W0426"));
}
