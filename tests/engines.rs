//! `engine:`: the engine a spec names reaches the plan.

use pipec_compiler::{compile, CompileOptions};
use pipec_plan::engine::EngineTarget;
use pipec_plan::vocab::Engine;
use pipec_plan::Plan;

/// A small GPT every engine runs: two blocks on two stages under 1F1B.
const GPT: &str = "name: engines-gpt
model:
  input: [32]
  layers:
    - embedding(64, 32)
    - repeat 2: transformer_block(d=32, heads=4, ff=64, causal=true)
    - layernorm
    - linear(32, 64)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 2
  device: { kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }
  links:
    intra_node: { bandwidth: 10GB/s, latency: 5us }
strategy:
  stages: straight
  schedule: 1f1b
  microbatches: 4
training:
  batch_size: 32
  steps: 3
  optimizer: { kind: adam, lr: 0.001 }
";

fn plan_of(text: &str) -> Plan {
    let checked = pipec_grammar::check_source(text);
    let spec = checked.spec.unwrap_or_else(|| panic!("the spec checks: {:?}", checked.diagnostics));
    compile(&spec, &CompileOptions::default()).into_compiled().expect("compiles").plan
}

#[test]
fn the_plan_records_the_engine_and_release_the_spec_names() {
    let plan = plan_of(&format!("engine: {{ name: megatron, version: \"0.19\" }}\n{GPT}"));
    assert_eq!(plan.engine, EngineTarget { name: Engine::Megatron, version: "0.19.2".into() });
    let json = serde_json::to_string(&plan).expect("serialises");
    assert!(json.contains(r#""engine":{"name":"megatron","version":"0.19.2"}"#), "{}", &json[..200]);
    assert_eq!(Plan::from_json(&json).expect("reads back").engine, plan.engine);
    let named = plan_of(&format!("engine: deepspeed\n{GPT}"));
    assert_eq!(named.engine, EngineTarget::newest(Engine::Deepspeed));
}

#[test]
fn a_plan_without_an_engine_is_pipecs_and_an_unknown_release_is_refused() {
    let plan = plan_of(GPT);
    assert!(plan.engine.is_pipec());
    let json = serde_json::to_string(&plan).expect("serialises");
    assert!(!json.contains("\"engine\""), "pipec, the default, is not written");
    assert!(Plan::from_json(&json).expect("reads").engine.is_pipec());
    let mut edited = plan.clone();
    edited.engine = EngineTarget { name: Engine::Megatron, version: "0.17.0".into() };
    let problems = edited.check();
    assert!(problems.iter().any(|p| p.contains("engine: pipec describes megatron 0.19.0 to 0.19.2")), "{problems:?}");
    let unknown =
        json.replacen("{\"version\":", "{\"engine\":{\"name\":\"jax\",\"version\":\"1.0.0\"},\"version\":", 1);
    assert!(Plan::from_json(&unknown).is_err_and(|e| e.contains("jax")));
}

/// The example specs whose model every engine could run (decoder-only language models).
const LANGUAGE_MODELS: &[&str] = &["auto", "gpt-tiny", "llama-tiny", "moe-tiny", "hybrid", "gpt2"];

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `text` with `engine: NAME` first and its strategy replaced by `strategy`.
fn for_engine(text: &str, engine: Engine, strategy: &str) -> String {
    let start = text.find("\nstrategy:").expect("a strategy") + 1;
    let end = text[start..].find("\ntraining:").map(|e| start + e + 1).expect("training after the strategy");
    format!("engine: {engine}\n{}{strategy}\n{}", &text[..start], &text[end..])
}

/// Every layout a search under `engine: X` plans, checked against X's capability table
/// through the front end (a layout it refuses would be E0702).
fn planned_layouts_run_on(text: &str, engine: Engine) -> usize {
    use pipec_compiler::search::{search, Outcome, SearchOptions};
    let checked = pipec_grammar::check_source(text);
    let Some(spec) = checked.spec else {
        // a model the engine does not train: refused before any search
        assert!(checked.diagnostics.iter().any(|d| d.code == "E0702"), "{:?}", checked.diagnostics);
        return 0;
    };
    let options = SearchOptions::from_spec(&spec, spec.strategy.auto.as_ref().expect("auto"));
    let report = search(text, &spec, &CompileOptions::default(), &options);
    let mut planned = 0;
    for c in &report.candidates {
        if !matches!(c.outcome, Outcome::Planned(_)) {
            continue;
        }
        planned += 1;
        let concrete = pipec_compiler::search::with_strategy(text, &spec, &c.strategy());
        let checked = pipec_grammar::check_source(&concrete);
        let s = checked.spec.expect("a planned candidate checks");
        let layout = pipec_grammar::engine_check::layout_of(&s.model, &s.strategy, &s.training, s.engine.compiled);
        let refused = pipec_plan::engine::capability::refusals(&spec.engine.target, &layout);
        assert!(refused.is_empty(), "{engine} cannot run {}: {refused:?}", c.strategy());
    }
    planned
}

#[test]
fn a_search_under_an_engine_plans_only_layouts_that_engine_runs() {
    for name in LANGUAGE_MODELS {
        let text = std::fs::read_to_string(root().join(format!("specs/{name}.yaml"))).expect("example");
        for engine in [Engine::Megatron, Engine::Torchtitan, Engine::Deepspeed] {
            let auto = for_engine(&text, engine, "strategy: auto");
            let planned = planned_layouts_run_on(&auto, engine);
            eprintln!("{name} under {engine}: {planned} layouts planned");
            // hybrid.yaml's blocks are not causal: only DeepSpeed takes any model
            assert_eq!(planned > 0, *name != "hybrid" || engine == Engine::Deepspeed, "{name} under {engine}");
        }
    }
}

#[test]
fn check_refuses_what_the_engine_lacks_at_its_key_with_the_nearest_as_fix() {
    let zbv =
        format!("engine: megatron\n{}", GPT.replace("schedule: 1f1b", "schedule: zbv").replace("repeat 2", "repeat 4"));
    let checked = pipec_grammar::check_source(&zbv);
    let d = checked.diagnostics.iter().find(|d| d.code == "E0702").expect("E0702");
    let at = d.span();
    assert_eq!(&zbv[at.start..at.end], "zbv");
    let fix = d.fix.as_ref().expect("a fix");
    assert_eq!(fix.replacement, "{ kind: interleaved, virtual_stages: 2 }");
    let fixed = format!("{}{}{}", &zbv[..fix.span.start], fix.replacement, &zbv[fix.span.end..]);
    let again = pipec_grammar::check_source(&fixed);
    assert!(again.diagnostics.iter().all(|d| !d.is_error()), "{:?}", again.diagnostics);
    // pipec runs it
    assert!(pipec_grammar::check_source(&GPT.replace("schedule: 1f1b", "schedule: zbv")).spec.is_some());
    // a model no strategy changes is refused under `strategy: auto` too
    let lstm = "engine: torchtitan\nmodel:\n  input: [16]\n  layers:\n    - embedding(50, 16)\n    - lstm(16, 16)\n    - linear(16, 50)\n  loss: cross_entropy\n";
    let rest = &GPT[GPT.find("cluster:").expect("cluster")..];
    let auto = format!(
        "{lstm}{}",
        rest.replace("strategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: 4\n", "strategy: auto\n")
    );
    let checked = pipec_grammar::check_source(&auto);
    assert!(
        checked.diagnostics.iter().any(|d| d.code == "E0702" && d.message.contains("decoder-only")),
        "{:?}",
        checked.diagnostics
    );
}

#[test]
fn compare_under_an_engine_plans_only_its_schedules() {
    let dir = std::env::temp_dir().join(format!("pipec-engines-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("gpt.yaml");
    std::fs::write(&path, format!("engine: megatron\n{}", GPT.replace("stages: straight", "pp: 2"))).expect("write");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pipec")).arg("compare").arg(&path).output().expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    for refused in ["gpipe", "zbv", "chimera", "dualpipev", "zb-h1"] {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(refused))
            .unwrap_or_else(|| panic!("{refused} row in:\n{text}"));
        assert!(line.contains("megatron"), "{line}");
    }
    let planned = text.lines().find(|l| l.trim_start().starts_with("1f1b")).expect("1f1b row");
    assert!(!planned.contains("megatron"), "{planned}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The engines `pipec emit` writes for.
const EMITTED: [Engine; 3] = [Engine::Megatron, Engine::Torchtitan, Engine::Deepspeed];

/// Every example language model's plan, as written, emitted for every engine: each file it
/// writes is a golden file, and a refusal's message too.
#[test]
fn emit_writes_each_engines_configuration_or_names_what_it_lacks() {
    let mut accepted = 0;
    for name in LANGUAGE_MODELS.iter().filter(|n| **n != "auto") {
        let text = std::fs::read_to_string(root().join(format!("specs/{name}.yaml"))).expect("example");
        let plan = plan_of(&text);
        for engine in EMITTED {
            match pipec_plan::engine::emit::emit(&plan, &EngineTarget::newest(engine)) {
                Ok(files) => {
                    accepted += 1;
                    for (file, contents) in files {
                        insta::assert_snapshot!(format!("emit__{name}__{engine}__{file}"), contents);
                    }
                }
                Err(why) => insta::assert_snapshot!(format!("emit__{name}__{engine}__refused"), why),
            }
        }
    }
    assert!(accepted >= 5, "{accepted} accepted");
}

/// The layout a plan's engine configuration carries: what `emit ∘ import` keeps.
fn carried(plan: &Plan) -> (pipec_plan::engine::capability::Layout, usize, usize) {
    (plan.engine_layout(), plan.training.batch_size, plan.training.microbatch_size)
}

/// `spec`'s plan, from the text `pipec import` wrote.
fn imported_plan(spec: Result<String, String>) -> Plan {
    plan_of(&spec.unwrap_or_else(|e| panic!("imports: {e}")))
}

/// emit ∘ import is the identity on the layout (and the batch, and the model's shape for the
/// engines whose configuration describes the model) for every example language model each
/// engine accepts.
#[test]
fn importing_what_emit_wrote_gives_back_the_layout() {
    use pipec_grammar::import::{deepspeed, megatron, torchtitan};
    let hf = |f: &str| std::fs::read_to_string(root().join("tests/import").join(f)).expect("an HF config");
    let (llama, mixtral) = (hf("llama-3-8b.json"), hf("mixtral-8x7b.json"));
    let mut round_trips = 0;
    for name in LANGUAGE_MODELS.iter().filter(|n| **n != "auto") {
        let text = std::fs::read_to_string(root().join(format!("specs/{name}.yaml"))).expect("example");
        let plan = plan_of(&text);
        let world = plan.devices.len();
        for engine in EMITTED {
            let Ok(files) = pipec_plan::engine::emit::emit(&plan, &EngineTarget::newest(engine)) else { continue };
            let file = |n: &str| files.iter().find(|(f, _)| f == n).map(|(_, t)| t.clone()).expect("emitted");
            let back = match engine {
                Engine::Megatron => imported_plan(megatron::import(&file("args.txt"), name, Some(world))),
                Engine::Torchtitan => imported_plan(torchtitan::import(&file("job.toml"), name, Some(world))),
                Engine::Deepspeed => imported_plan(deepspeed::import(
                    &file("ds_config.json"),
                    if plan.gpt_shape().and_then(|g| g.moe()).is_some() { &mixtral } else { &llama },
                    name,
                    Some(world),
                    Some(plan.model.input[0]),
                )),
                Engine::Pipec => unreachable!("not emitted"),
            };
            let (mut want, mut got) = (carried(&plan), carried(&back));
            if engine == Engine::Deepspeed {
                // DeepSpeed's config holds no model: the model is the config.json's
                (want.0.blocks, want.0.gpt, got.0.blocks, got.0.gpt) = (0, true, 0, true);
                (want.0.chunk_blocks, got.0.chunk_blocks) = (None, None);
            } else {
                assert_eq!(
                    back.gpt_shape().map(|g| (
                        g.vocab,
                        g.layers,
                        g.block.d,
                        g.block.heads,
                        g.block.kv_heads,
                        g.block.ff,
                        g.block.moe
                    )),
                    plan.gpt_shape().map(|g| (
                        g.vocab,
                        g.layers,
                        g.block.d,
                        g.block.heads,
                        g.block.kv_heads,
                        g.block.ff,
                        g.block.moe
                    )),
                    "{name} via {engine}"
                );
            }
            assert_eq!(got, want, "{name} via {engine}");
            assert_eq!(back.engine.name, engine);
            round_trips += 1;
        }
    }
    // (gpt2's plan, balanced for pipec's executor, puts 4, 4, 4 and 0 blocks on its stages,
    // which Megatron-LM does not run: refused)
    assert!(round_trips >= 6, "{round_trips}");
}

/// The published layouts (tests/engines/published; each file says where it is from) with the
/// GPUs they run on where the file does not say, and the engine they are for.
fn published() -> Vec<(String, Engine, String)> {
    use pipec_grammar::import::{deepspeed, megatron, torchtitan};
    let dir = root().join("tests/engines/published");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).expect("a published layout");
    let mut out = Vec::new();
    for f in [
        "megatron-llama3-8b-fp8.sh",
        "megatron-fsdp-llama3-8b-fp8.sh",
        "megatron-mixtral-8x7b.sh",
        "megatron-gpt3-175b.args",
    ]
    .into_iter()
    .chain(["llama3-8b", "llama3-70b", "mixtral-8x7b", "mixtral-8x22b"].map(|m| match m {
        "llama3-8b" => "megatron-docs-llama3-8b.args",
        "llama3-70b" => "megatron-docs-llama3-70b.args",
        "mixtral-8x7b" => "megatron-docs-mixtral-8x7b.args",
        _ => "megatron-docs-mixtral-8x22b.args",
    })) {
        let name = f.rsplit_once('.').expect("an extension").0;
        out.push((name.to_string(), Engine::Megatron, megatron::import(&read(f), name, None).expect(f)));
    }
    for (flavour, gpus) in [("8b", 64), ("70b", 64), ("405b", 128)] {
        let name = format!("torchtitan-llama3-{flavour}");
        let spec = torchtitan::import(&read(&format!("{name}.toml")), &name, Some(gpus)).expect("imports");
        out.push((name, Engine::Torchtitan, spec));
    }
    let llama2 = std::fs::read_to_string(root().join("tests/import/llama-2-7b.json")).expect("config");
    let spec =
        deepspeed::import(&read("deepspeed-llama2-7b.json"), &llama2, "deepspeed-llama2-7b", Some(2), Some(4096));
    out.push(("deepspeed-llama2-7b".into(), Engine::Deepspeed, spec.expect("imports")));
    out
}

/// Twelve published layouts (Megatron-LM's examples and its parallelism guide's table,
/// torchtitan's Llama 3 configurations, a DeepSpeed config) import into specs that check
/// (the written spec is a golden file), compile, and emit back for their engine with the
/// same layout.
#[test]
fn published_layouts_import_check_compile_and_emit_back() {
    let all = published();
    assert!(all.len() >= 12);
    let mut over_memory = Vec::new();
    for (name, engine, spec) in &all {
        insta::assert_snapshot!(format!("import__{name}"), spec);
        let checked = pipec_grammar::check_source(spec);
        let result = compile(&checked.spec.expect("checks"), &CompileOptions::default());
        // the only error compile may give: pipec's memory model puts a device over its 80 GB
        for d in result.diagnostics.iter().filter(|d| d.is_error()) {
            assert_eq!(d.code, "E0601", "{name}: {}", d.message);
            over_memory.push(name.as_str());
        }
        let plan = result.into_compiled().expect("a plan").plan;
        assert_eq!(plan.engine.name, *engine);
        let files = pipec_plan::engine::emit::emit(&plan, &plan.engine).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(files.iter().any(|(f, _)| f == "prediction.json"));
    }
    over_memory.dedup();
    insta::assert_snapshot!("import__over_memory", over_memory.join("\n"));
}

/// The search under `engine: X` on the published layouts' models and clusters (their
/// strategies left to it) plans only layouts X runs, as on the example specs.
#[test]
fn a_search_on_the_imported_specs_plans_only_layouts_their_engine_runs() {
    let mut planned = 0;
    for (name, engine, spec) in published() {
        // the imported engine line as written (`compile` beside the name, for torchtitan)
        let line = spec.lines().find(|l| l.starts_with("engine:")).expect("an engine").to_string();
        let auto = for_engine(
            spec.replacen(&format!("{line}\n"), "", 1).as_str(),
            engine,
            "strategy: { tp: auto, pp: auto, dp: auto, schedule: auto, microbatches: auto, recompute: auto }",
        )
        .replacen(&format!("engine: {engine}\n"), &format!("{line}\n"), 1);
        let n = planned_layouts_run_on(&auto, engine);
        eprintln!("{name} under {engine}: {n} layouts planned");
        planned += n;
    }
    assert!(planned > 0);
}

/// `pipec emit` writes a new folder whole, refuses an existing one, a file that is neither a
/// spec nor a plan, and a spec that names no engine without `--engine`; `pipec import` tells a
/// `--model-config` that is not a Hugging Face config what it is.
#[test]
fn emit_and_import_refuse_what_they_cannot_read_or_write() {
    let dir = std::env::temp_dir().join(format!("pipec-engines-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let pipec = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pipec"))
            .args(args)
            .env("PIPEC_CPU_CALIBRATION", "off")
            .output()
            .expect("runs")
    };
    let spec = dir.join("gpt.yaml");
    std::fs::write(&spec, GPT).expect("write");
    let out = dir.join("launch");
    let no_engine = pipec(&["emit".as_ref(), spec.as_os_str(), "-o".as_ref(), out.as_os_str()]);
    assert_eq!(no_engine.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no_engine.stderr).contains("--engine"));
    let written = pipec(&[
        "emit".as_ref(),
        "--engine".as_ref(),
        "megatron".as_ref(),
        spec.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    assert_eq!(written.status.code(), Some(0), "{}", String::from_utf8_lossy(&written.stderr));
    for f in ["train.sh", "args.txt", "job.sbatch", "prediction.json", "NOTES.md"] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let again = pipec(&[
        "emit".as_ref(),
        "--engine".as_ref(),
        "megatron".as_ref(),
        spec.as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
    ]);
    assert_eq!(again.status.code(), Some(2), "an existing folder is not overwritten");
    let toml = dir.join("job.toml");
    std::fs::write(&toml, "[model]\nname = \"llama3\"\n").expect("write");
    let wrong = pipec(&[
        "emit".as_ref(),
        "--engine".as_ref(),
        "megatron".as_ref(),
        toml.as_os_str(),
        "-o".as_ref(),
        dir.join("x").as_os_str(),
    ]);
    assert_eq!(wrong.status.code(), Some(2));
    assert!(!dir.join("x").exists());
    let ds = dir.join("ds_config.json");
    std::fs::write(&ds, r#"{"train_batch_size": 8}"#).expect("write");
    let told = pipec(&[
        "import".as_ref(),
        ds.as_os_str(),
        "--gpus".as_ref(),
        "8".as_ref(),
        "--model-config".as_ref(),
        toml.as_os_str(),
    ]);
    assert_eq!(told.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&told.stderr)
            .contains("is a torchtitan TOML job configuration, not a Hugging Face config.json"),
        "{}",
        String::from_utf8_lossy(&told.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `moe_dispatch: deepep` (DeepEP's dispatch): Megatron-LM's flex dispatcher and
/// torchtitan's DeepEP backend accepted, DeepSpeed refused at the key.
#[test]
fn deepep_dispatch_is_emitted_as_each_engine_names_it_or_refused() {
    let text = std::fs::read_to_string(root().join("specs/moe-tiny.yaml")).expect("example");
    let deepep = text.replacen("  ep: 2\n", "  ep: 2\n  moe_dispatch: deepep\n", 1);
    assert_ne!(deepep, text, "moe-tiny has `ep: 2`");
    let plan = plan_of(&deepep);
    assert_eq!(plan.schedule.moe_dispatch, pipec_plan::vocab::MoeDispatch::DeepEp);
    let all = |engine: Engine| -> String {
        let files = pipec_plan::engine::emit::emit(&plan, &EngineTarget::newest(engine)).expect("emits");
        files.into_iter().map(|(_, contents)| contents).collect()
    };
    let megatron = all(Engine::Megatron);
    assert!(megatron.contains("--moe-token-dispatcher-type flex"), "{megatron}");
    assert!(megatron.contains("--moe-flex-dispatcher-backend deepep"), "{megatron}");
    // torchtitan runs it (its emitter names Llama 3's flavours only, not this model)
    let sharded = deepep.replacen("  ep: 2\n", "  ep: 2\n  zero: 3\n", 1);
    let titan = pipec_grammar::check_source(&format!("engine: torchtitan\n{sharded}"));
    assert!(
        !titan.diagnostics.iter().any(|d| d.message.contains("DeepEP")),
        "{:?}",
        titan.diagnostics.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
    let refused = pipec_grammar::check_source(&format!("engine: deepspeed\n{deepep}"));
    assert!(
        refused.diagnostics.iter().any(|d| d.code == "E0702" && d.message.contains("DeepEP")),
        "{:?}",
        refused.diagnostics.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
}

/// `ep_overlap` (Megatron-LM's expert-parallel overlap): emitted as
/// `--overlap-moe-expert-parallel-comm` beside the flex dispatcher, read back from the
/// emitted arguments with the dispatch; torchtitan and DeepSpeed refuse it at the key
/// (E0702), and Megatron-LM refuses it beside full recompute (its own assertion).
#[test]
fn ep_overlap_is_emitted_for_megatron_read_back_and_refused_elsewhere() {
    use pipec_grammar::import::megatron;
    let text = std::fs::read_to_string(root().join("specs/moe-tiny.yaml")).expect("example");
    let one_stage = text.replacen("  stages: \"2-2\"\n", "  stages: \"4\"\n", 1);
    let overlapped = one_stage.replacen("  ep: 2\n", "  ep: 2\n  moe_dispatch: deepep\n  ep_overlap: true\n", 1);
    assert_ne!(overlapped, one_stage, "moe-tiny has `ep: 2`");
    let plan = plan_of(&overlapped);
    assert!(plan.schedule.ep_overlap);
    let files = pipec_plan::engine::emit::emit(&plan, &EngineTarget::newest(Engine::Megatron)).expect("emits");
    let args = files.into_iter().find(|(f, _)| f == "args.txt").map(|(_, t)| t).expect("args.txt");
    assert!(args.contains("--overlap-moe-expert-parallel-comm"), "{args}");
    let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
    assert!(back.schedule.ep_overlap, "read back");
    assert_eq!(back.schedule.moe_dispatch, pipec_plan::vocab::MoeDispatch::DeepEp);
    for engine in ["torchtitan", "deepspeed"] {
        let refused = pipec_grammar::check_source(&format!("engine: {engine}\n{overlapped}"));
        assert!(
            refused
                .diagnostics
                .iter()
                .any(|d| d.code == "E0702" && d.message.contains("overlapped with another microbatch")),
            "{engine}: {:?}",
            refused.diagnostics.iter().map(|d| &d.message).collect::<Vec<_>>()
        );
    }
    let recomputed = overlapped.replacen("  ep: 2\n", "  ep: 2\n  recompute: true\n", 1);
    let refused = pipec_grammar::check_source(&format!("engine: megatron\n{recomputed}"));
    assert!(
        refused.diagnostics.iter().any(|d| d.code == "E0702" && d.message.contains("full recompute")),
        "{:?}",
        refused.diagnostics.iter().map(|d| &d.message).collect::<Vec<_>>()
    );
}

/// FP8 training crosses to and from each engine's own switches: an FP8 plan emitted for
/// Megatron-LM (Transformer Engine's `--fp8-format hybrid --fp8-recipe R`, FP8 gathers
/// with `--fp8-param-gather`) and torchtitan (torchao's `quantize.linear.float8` converter,
/// `rowwise` by name) imports back with the same recipe and gathers; DeepSpeed, whose
/// configuration has no FP8, refuses it naming the precision, and a recipe an engine lacks
/// is refused naming the ones it runs.
#[test]
fn fp8_is_emitted_as_each_engine_switches_it_on_and_imported_back() {
    use pipec_grammar::import::{megatron, torchtitan};
    use pipec_plan::vocab::{Fp8Recipe, Fp8Storage};
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let with_fp8 = |zero: &str, fp8: &str| {
        let t = text.replacen("precision: bf16", &format!("precision: fp8\n  fp8: {fp8}"), 1);
        let t = if t.contains("precision: fp8") {
            t
        } else {
            t.replacen("training:\n", &format!("training:\n  precision: fp8\n  fp8: {fp8}\n"), 1)
        };
        // two replicas of each stage, for the optimizer's shards
        let t = t.replacen("devices_per_node: 2", "devices_per_node: 4", 1).replacen(
            "stages: \"1-1\"",
            "stages: \"2-2\"",
            1,
        );
        plan_of(&t.replacen("strategy:\n", &format!("strategy:\n  zero: {zero}\n"), 1))
    };
    let emitted = |plan: &Plan, engine: Engine, file: &str| -> Result<String, String> {
        let files = pipec_plan::engine::emit::emit(plan, &EngineTarget::newest(engine))?;
        Ok(files.into_iter().find(|(f, _)| f == file).map(|(_, t)| t).expect("emitted"))
    };
    // Megatron-LM: current scaling, FP8 gathers of the distributed optimizer
    let plan = with_fp8("1", "{ recipe: tensorwise, gather: fp8 }");
    assert_eq!(plan.training.fp8.map(|f| f.recipe), Some(Fp8Recipe::Tensorwise));
    let args = emitted(&plan, Engine::Megatron, "args.txt").expect("megatron runs it");
    assert!(args.contains("--fp8-format hybrid") && args.contains("--fp8-recipe tensorwise"), "{args}");
    assert!(args.contains("--fp8-param-gather") && args.contains("--bf16"), "{args}");
    let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
    let f = back.training.fp8.expect("FP8 read back");
    assert_eq!((f.recipe, f.gather), (Fp8Recipe::Tensorwise, Fp8Storage::Fp8));
    assert_eq!(carried(&back).0, carried(&plan).0);
    // torchtitan: rowwise under FSDP
    let plan = with_fp8("3", "{ recipe: rowwise, activations: bf16, weight_copies: false }");
    match emitted(&plan, Engine::Torchtitan, "job.toml") {
        Ok(job) => {
            assert!(job.contains("converters = [\"quantize.linear.float8\"]"), "{job}");
            assert!(job.contains("[quantize.linear.float8]") && job.contains("recipe_name = \"rowwise\""), "{job}");
            let back = imported_plan(torchtitan::import(&job, "back", Some(plan.devices.len())));
            assert_eq!(back.training.fp8.map(|f| f.recipe), Some(Fp8Recipe::Rowwise));
        }
        // llama-tiny is no torchtitan flavour: the refusal says so, not FP8
        Err(e) => assert!(e.contains("flavour"), "{e}"),
    }
    // the published torchtitan 405B configuration's float8 converter reads as tensorwise FP8
    let job =
        std::fs::read_to_string(root().join("tests/engines/published/torchtitan-llama3-405b.toml")).expect("toml");
    let back = imported_plan(torchtitan::import(&job, "405b", Some(128)));
    assert_eq!(back.training.fp8.map(|f| (f.recipe, f.activations)), Some((Fp8Recipe::Tensorwise, Fp8Storage::Bf16)));
    let job = emitted(&back, Engine::Torchtitan, "job.toml").expect("torchtitan runs it");
    assert!(job.contains("converters = [\"quantize.linear.float8\"]") && !job.contains("recipe_name"), "{job}");
    // DeepSpeed has no FP8; Megatron-LM no rowwise recipe
    let e =
        emitted(&with_fp8("1", "{ recipe: tensorwise }"), Engine::Deepspeed, "ds_config.json").expect_err("refused");
    assert!(e.contains("no FP8"), "{e}");
    let e = emitted(&with_fp8("1", "{ recipe: rowwise }"), Engine::Megatron, "args.txt").expect_err("refused");
    assert!(e.contains("rowwise recipe") && e.contains("tensorwise"), "{e}");
    // what an engine's configuration cannot say of the FP8 storage is named in NOTES.md:
    // Megatron-LM keeps Transformer Engine's weight copies (no switch for
    // `disable_parameter_transpose_cache`) and FP8 inputs; torchao keeps neither
    let not_said = |plan: &Plan, engine: Engine| {
        let notes = emitted(plan, engine, "NOTES.md").expect("emitted");
        notes.split("## Not carried over from the plan").nth(1).expect("the section").to_string()
    };
    let lost = not_said(&with_fp8("1", "{ recipe: tensorwise }"), Engine::Megatron);
    assert!(!lost.contains("fp8."), "{lost}");
    let lost =
        not_said(&with_fp8("1", "{ recipe: tensorwise, activations: bf16, weight_copies: false }"), Engine::Megatron);
    assert!(lost.contains("`fp8.weight_copies: false`") && lost.contains("`fp8.activations: bf16`"), "{lost}");
    assert!(!not_said(&back, Engine::Torchtitan).contains("fp8."), "the imported 405B run says what torchao keeps");
    let mut cached = back.clone();
    cached.training.fp8 = cached.training.fp8.map(|f| pipec_plan::plan::Fp8Plan { weight_copies: true, ..f });
    assert!(not_said(&cached, Engine::Torchtitan).contains("`fp8.weight_copies: true`"));
}

/// Gradients reduced in bf16 and Adam's moments in bf16 are emitted as Megatron-LM switches
/// them on (`--grad-reduce-in-bf16`; the precision-aware optimizer over the distributed
/// optimizer) and read back by its import; torchtitan (FP32 reductions only at 0.2.2) and
/// DeepSpeed (as pipec writes its configuration) refuse them rather than emit a run that
/// holds more memory than the plan, and Megatron-LM refuses bf16 moments without its
/// distributed optimizer.
#[test]
fn bf16_gradients_and_moments_are_emitted_for_megatron_read_back_and_refused_elsewhere() {
    use pipec_grammar::import::megatron;
    use pipec_plan::vocab::Precision;
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let with = |zero: &str, training: &str| {
        let t = text.replacen("devices_per_node: 2", "devices_per_node: 4", 1).replacen(
            "stages: \"1-1\"",
            "stages: \"2-2\"",
            1,
        );
        let t = t.replacen("strategy:\n", &format!("strategy:\n  zero: {zero}\n"), 1);
        plan_of(&t.replacen("training:\n", &format!("training:\n{training}"), 1))
    };
    let emitted = |plan: &Plan, engine: Engine, file: &str| -> Result<String, String> {
        let files = pipec_plan::engine::emit::emit(plan, &EngineTarget::newest(engine))?;
        Ok(files.into_iter().find(|(f, _)| f == file).map(|(_, t)| t).expect("emitted"))
    };
    let both = "  precision: bf16\n  grad_precision: bf16\n";
    let plan = with("1", both);
    let mut plan_state = plan.clone();
    plan_state.training.state_precision = Precision::Bf16;
    assert_eq!(plan.training.grad_precision, Precision::Bf16);
    let args = emitted(&plan, Engine::Megatron, "args.txt").expect("megatron runs it");
    assert!(args.contains("--grad-reduce-in-bf16") && !args.contains("--use-precision-aware-optimizer"), "{args}");
    let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
    assert_eq!(back.training.grad_precision, Precision::Bf16);
    assert_eq!(carried(&back).0, carried(&plan).0);
    // without the flag, Megatron-LM's --bf16 reduces in fp32, and the import says so
    let fp32 = imported_plan(megatron::import(&args.replace("--grad-reduce-in-bf16", ""), "back", Some(8)));
    assert_eq!(fp32.training.grad_precision, Precision::Fp32);
    // the moments in bf16: the precision-aware optimizer, read back
    let args = emitted(&plan_state, Engine::Megatron, "args.txt").expect("megatron runs it");
    for flag in ["--use-precision-aware-optimizer", "--exp-avg-dtype bf16", "--exp-avg-sq-dtype bf16"] {
        assert!(args.contains(flag), "{flag}: {args}");
    }
    let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
    assert_eq!(back.training.state_precision, Precision::Bf16);
    assert_eq!(carried(&back).0, carried(&plan_state).0);
    // moments in two precisions are refused by the import, not dropped
    let mixed = args.replace("--exp-avg-sq-dtype bf16", "--exp-avg-sq-dtype fp32");
    let e = megatron::import(&mixed, "back", Some(8)).expect_err("refused");
    assert!(e.contains("one precision"), "{e}");
    // without the distributed optimizer Megatron-LM has no precision-aware optimizer
    let mut plain = with("0", both);
    plain.training.state_precision = Precision::Bf16;
    let e = emitted(&plain, Engine::Megatron, "args.txt").expect_err("refused");
    assert!(e.contains("distributed optimizer"), "{e}");
    // DeepSpeed refuses both, as pipec writes its configuration
    let e = emitted(&plan, Engine::Deepspeed, "ds_config.json").expect_err("refused");
    assert!(e.contains("grad_precision: bf16"), "{e}");
    let e = emitted(&plan_state, Engine::Deepspeed, "ds_config.json").expect_err("refused");
    assert!(e.contains("state_precision: bf16"), "{e}");
}

/// Recompute inside the blocks is written as each engine runs it or refused, never dropped:
/// Megatron-LM's full recompute of the first layers (`--recompute-method block`) and its
/// selective recompute of named modules (`--recompute-modules`), both read back by its
/// import; torchtitan's op-level policy (`selective_ac_option = "op"`) for `ops:
/// [alternate_matmul, attention]`, read back as those operations, and `torch.compile` for a
/// compiled torchtitan plan; what an engine has no setting for is refused by name.
#[test]
fn recompute_inside_the_blocks_is_emitted_as_each_engine_runs_it_or_refused() {
    use pipec_grammar::import::{megatron, torchtitan};
    use pipec_plan::vocab::RecomputeModule;
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    // one stage of 2 blocks on 2 replicas
    let with = |recompute: &str, engine: &str| {
        let t = text.replacen("stages: \"1-1\"", &format!("stages: \"2\"\n  recompute: {recompute}"), 1);
        plan_of(&format!("{engine}{t}"))
    };
    let emitted = |plan: &Plan, engine: Engine, file: &str| -> Result<String, String> {
        let files = pipec_plan::engine::emit::emit(plan, &EngineTarget::newest(engine))?;
        Ok(files.into_iter().find(|(f, _)| f == file).map(|(_, t)| t).expect("emitted"))
    };
    // Megatron-LM: the first block of the stage recomputed whole
    let plan = with("{ layers: 1 }", "");
    let args = emitted(&plan, Engine::Megatron, "args.txt").expect("megatron runs it");
    for flag in ["--recompute-granularity full", "--recompute-method block", "--recompute-num-layers 1"] {
        assert!(args.contains(flag), "{flag}: {args}");
    }
    let back = imported_plan(megatron::import(&args, "back", Some(2)));
    assert_eq!(back.schedule.block_recompute.as_ref().map(|b| b.layers), Some(1));
    // named modules, selectively
    let plan = with("{ modules: [layernorm, mlp] }", "");
    let args = emitted(&plan, Engine::Megatron, "args.txt").expect("megatron runs it");
    assert!(args.contains("--recompute-granularity selective"), "{args}");
    assert!(
        args.contains("--recompute-modules mlp layernorm") || args.contains("--recompute-modules layernorm mlp"),
        "{args}"
    );
    let back = imported_plan(megatron::import(&args, "back", Some(2)));
    let mut modules = back.schedule.block_recompute.expect("modules read back").modules;
    modules.sort_by_key(|m| m.name());
    assert_eq!(modules, [RecomputeModule::Layernorm, RecomputeModule::Mlp]);
    // an unknown module is refused by the import, not dropped
    let e = megatron::import(&args.replace("layernorm", "everything"), "back", Some(2)).expect_err("refused");
    assert!(e.contains("everything"), "{e}");
    // operations, offload, and modules beside layers have no Megatron-LM setting
    for (recompute, why) in [
        ("{ ops: [alternate_matmul, attention] }", "not a list of operations"),
        ("{ modules: [mlp], layers: 1 }", "not both"),
        ("{ offload: true }", "offload"),
    ] {
        let e = emitted(&with(recompute, ""), Engine::Megatron, "args.txt").expect_err("refused");
        assert!(e.contains(why), "{recompute}: {e}");
    }
    // torchtitan: its op-level policy, compiled
    let llama =
        std::fs::read_to_string(root().join("tests/engines/published/torchtitan-llama3-8b.toml")).expect("toml");
    let spec = torchtitan::import(&llama, "tt", Some(8)).expect("imports");
    assert!(spec.contains("recompute: { ops: [alternate_matmul, attention] }"), "{spec}");
    let compiled = spec.replacen("engine: torchtitan", "engine: { name: torchtitan, compile: true }", 1);
    let job = emitted(&plan_of(&compiled), Engine::Torchtitan, "job.toml").expect("torchtitan runs it");
    assert!(job.contains("mode = \"selective\"") && job.contains("selective_ac_option = \"op\""), "{job}");
    assert!(job.contains("[compile]\nenable = true"), "{job}");
    let job = emitted(&plan_of(&spec), Engine::Torchtitan, "job.toml").expect("torchtitan runs it");
    assert!(job.contains("[compile]\nenable = false"), "{job}");
    // torchtitan has no first-layers recompute, DeepSpeed no recompute inside a block
    // (planned under pipec: `check` refuses it under `engine: torchtitan`)
    let layers = spec
        .replacen("recompute: { ops: [alternate_matmul, attention] }", "recompute: { layers: 1 }", 1)
        .replacen("engine: torchtitan", "engine: pipec", 1);
    let e = emitted(&plan_of(&layers), Engine::Torchtitan, "job.toml").expect_err("refused");
    assert!(e.contains("op-level policy"), "{e}");
    let e = emitted(&with("{ layers: 1 }", ""), Engine::Deepspeed, "ds_config.json").expect_err("refused");
    assert!(e.contains("deepspeed") && e.contains("whole layers"), "{e}");
}

/// `pipec check` holds recompute inside the blocks to the named engine part by part, as
/// `emit` does: E0702 at the `recompute` value, with the nearest the engine runs as the fix
/// — the mapping without the refused parts, else what the engine runs inside the blocks
/// (torchtitan's op-level policy, Megatron-LM's selective recompute), else `true` — which
/// then checks clean.
#[test]
fn check_holds_recompute_inside_the_blocks_to_the_engine_at_its_value() {
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let spec = |engine: &str, recompute: &str| {
        format!(
            "engine: {engine}\n{}",
            text.replacen("stages: \"1-1\"", &format!("stages: \"2\"\n  recompute: {recompute}"), 1)
        )
    };
    let e0702 = |source: &str| {
        let checked = pipec_grammar::check_source(source);
        checked.diagnostics.iter().find(|d| d.code == "E0702").cloned()
    };
    for (engine, ok) in [
        ("megatron", "{ modules: [layernorm, mlp] }"),
        ("megatron", "{ layers: 1 }"),
        ("torchtitan", "{ ops: [alternate_matmul, attention] }"),
        ("pipec", "{ ops: [matmul], offload: true }"),
    ] {
        let source = spec(engine, ok);
        assert!(e0702(&source).is_none(), "{engine} {ok}: {:?}", pipec_grammar::check_source(&source).diagnostics);
    }
    for (engine, refused, why, fix) in [
        ("megatron", "{ ops: [alternate_matmul, attention] }", "not a list of operations", "selective"),
        ("megatron", "{ modules: [mlp], layers: 1 }", "not both", "{ modules: [mlp] }"),
        ("megatron", "{ layers: 1, offload: true }", "offload", "{ layers: 1 }"),
        ("torchtitan", "{ modules: [mlp] }", "op-level policy", "{ ops: [alternate_matmul, attention] }"),
        ("deepspeed", "{ layers: 1 }", "whole layers", "true"),
    ] {
        let source = spec(engine, refused);
        let d = e0702(&source).unwrap_or_else(|| panic!("{engine} {refused}: no E0702"));
        assert!(d.message.contains(why), "{engine} {refused}: {}", d.message);
        let at = d.span();
        assert_eq!(&source[at.start..at.end], refused, "{engine}: located at the value");
        match d.fix.as_ref() {
            Some(f) => {
                assert_eq!(f.replacement, fix, "{engine} {refused}");
                if engine != "deepspeed" {
                    let fixed = format!("{}{}{}", &source[..f.span.start], f.replacement, &source[f.span.end..]);
                    assert!(e0702(&fixed).is_none(), "{fixed}");
                }
            }
            None => assert!(fix.is_empty(), "{engine} {refused}: no fix"),
        }
    }
}

/// Today's attention shapes reach Megatron-LM as the flags that build them, and its import
/// reads the same block back (every size, norm, window, sink, latent and rotary scaling):
/// a head size of its own (`--kv-channels`), query/key norms (`--qk-layernorm`), a sliding
/// window (`--window-size L,0`: L keys before each query and itself), sinks (`--softmax-type
/// learnable`), multi-head latent attention with and without a query latent
/// (`--multi-latent-attention`, its ranks and head sizes, plain rotary embeddings), Llama
/// 3.1's rotary scaling (`--use-rope-scaling`). torchtitan's llama3 flavours have none of
/// them: a block with one is refused, not written as a flavour that lacks it. Scaling other
/// than Llama 3.1's is refused by Megatron-LM too.
#[test]
fn todays_attention_shapes_are_emitted_for_megatron_read_back_and_refused_by_torchtitan() {
    use pipec_grammar::import::megatron;
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let plain = "transformer_block(d=64, heads=4, ff=172, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)";
    assert!(text.contains(plain), "specs/llama-tiny.yaml's block changed");
    let with = |args: &str| plan_of(&text.replacen(plain, &plain.replacen(")", &format!(", {args})"), 1), 1));
    let emitted = |plan: &Plan, engine: Engine, file: &str| -> Result<String, String> {
        let files = pipec_plan::engine::emit::emit(plan, &EngineTarget::newest(engine))?;
        Ok(files.into_iter().find(|(f, _)| f == file).map(|(_, t)| t).expect("emitted"))
    };
    let mla_no_kv = |args: &str| {
        let t = text.replacen(plain, &plain.replacen(", kv_heads=2", "", 1).replacen(")", &format!(", {args})"), 1), 1);
        plan_of(&t)
    };
    let cases: Vec<(Plan, Vec<&str>)> = vec![
        (with("head_dim=32"), vec!["--kv-channels 32"]),
        (with("qk_norm=true"), vec!["--qk-layernorm"]),
        (with("window=16"), vec!["--window-size 15,0"]),
        (with("sinks=true"), vec!["--softmax-type learnable"]),
        (
            mla_no_kv("head_dim=16, kv_lora=32, q_lora=48, rope_dim=8, v_head_dim=24"),
            vec![
                "--multi-latent-attention",
                "--q-lora-rank 48",
                "--kv-lora-rank 32",
                "--qk-head-dim 16",
                "--qk-pos-emb-head-dim 8",
                "--v-head-dim 24",
                "--rope-type rope",
                "--no-rope-fusion",
            ],
        ),
        (mla_no_kv("head_dim=16, kv_lora=32, rope_dim=8, v_head_dim=24"), vec!["--multi-latent-attention"]),
        (
            with("rope_scaling=llama3, rope_factor=8, rope_low_freq=1, rope_high_freq=4, rope_original=8192"),
            vec!["--use-rope-scaling", "--rope-scaling-factor 8"],
        ),
    ];
    for (plan, flags) in cases {
        let block = plan.gpt_shape().expect("a language model").block;
        let args = emitted(&plan, Engine::Megatron, "args.txt").unwrap_or_else(|e| panic!("megatron: {e}"));
        for f in flags {
            assert!(args.contains(f), "{f}: {args}");
        }
        assert_eq!(args.contains("--group-query-attention"), block.mla.is_none(), "{args}");
        let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
        assert_eq!(back.gpt_shape().expect("a language model").block, block, "{args}");
        assert_eq!(carried(&back).0, carried(&plan).0);
        let e = emitted(&plan, Engine::Torchtitan, "job.toml").expect_err("no llama3 flavour has it");
        assert!(e.contains("flavour"), "{e}");
    }
    let yarn = with("rope_scaling=yarn, rope_factor=4, rope_original=1024");
    let e = emitted(&yarn, Engine::Megatron, "args.txt").expect_err("refused");
    assert!(e.contains("rope_scaling=yarn"), "{e}");
}

/// Blocks alternating a sliding window and full attention (GPT-OSS: every second block
/// attends fully) are Megatron-LM's `--window-size L,0 --window-attn-skip-freq N`; the import
/// reads them back as the same blocks, and refuses a list pattern or a count that does not
/// divide the layers. Megatron-LM's own `is_layer_window_attention` gives the same windows
/// (`scripts/engine_check.py` compares prediction.json's `block_windows`).
#[test]
fn blocks_alternating_a_window_and_full_attention_are_megatrons_skip_frequency() {
    use pipec_grammar::import::megatron;
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let plain = "transformer_block(d=64, heads=4, ff=172, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)";
    let windowed = plain.replacen(")", ", window=16)", 1);
    let layers = |group: &[&str], times: usize| {
        text.replacen(&format!("repeat 2: {plain}"), &format!("repeat {times}: {}", group.join(" -> ")), 1)
    };
    let files = |plan: &Plan| pipec_plan::engine::emit::emit(plan, &EngineTarget::newest(Engine::Megatron));
    let file = |files: &[(String, String)], name: &str| {
        files.iter().find(|(f, _)| f == name).map(|(_, t)| t.clone()).expect("emitted")
    };
    for (group, every) in [(vec![windowed.as_str(), plain], 2), (vec![windowed.as_str(), windowed.as_str(), plain], 3)]
    {
        let plan = plan_of(&layers(&group, 2));
        let shape = plan.gpt_shape().expect("a language model");
        assert_eq!((shape.full_every, shape.block.window), (every, 16));
        let emitted = files(&plan).expect("megatron runs it");
        let args = file(&emitted, "args.txt");
        assert!(
            args.contains("--window-size 15,0") && args.contains(&format!("--window-attn-skip-freq {every}")),
            "{args}"
        );
        let prediction: serde_json::Value = serde_json::from_str(&file(&emitted, "prediction.json")).expect("json");
        let want: Vec<usize> = (1..=2 * every).map(|i| if i % every == 0 { 0 } else { 16 }).collect();
        assert_eq!(prediction["block_windows"], serde_json::json!(want));
        // read back: the same blocks, each with its own window
        let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
        let blocks = |p: &Plan| p.layers.iter().map(|l| l.op.clone()).collect::<Vec<_>>();
        assert_eq!(blocks(&back), blocks(&plan), "{args}");
    }
    // a window on every block writes no skip frequency; blocks alternating irregularly are not
    // a shape the engines' configurations describe
    let uniform = plan_of(&layers(&[windowed.as_str()], 4));
    assert_eq!(uniform.gpt_shape().expect("shape").full_every, 0);
    assert!(!file(&files(&uniform).expect("emits"), "args.txt").contains("--window-attn-skip-freq"));
    let irregular = plan_of(&layers(&[plain, windowed.as_str()], 2));
    assert!(irregular.gpt_shape().is_none(), "full attention first, then the window");
    let e = files(&irregular).expect_err("refused");
    assert!(e.contains("decoder-only"), "{e}");
    // the import: a list pattern, or groups that do not divide the layers, are refused by name
    let args = file(&files(&plan_of(&layers(&[windowed.as_str(), plain], 2))).expect("emits"), "args.txt");
    let listed = args.replace("--window-attn-skip-freq 2", "--window-attn-skip-freq [1,0,1,0]");
    let e = megatron::import(&listed, "x", Some(2)).expect_err("a list pattern");
    assert!(e.contains("list pattern"), "{e}");
    let odd = args.replace("--num-layers 4", "--num-layers 5");
    let e = megatron::import(&odd, "x", Some(2)).expect_err("5 layers in groups of 2");
    assert!(e.contains("--window-attn-skip-freq 2"), "{e}");
    // a skip frequency without a window changes nothing
    let no_window = args.replace("--window-size 15,0", "");
    let back = imported_plan(megatron::import(&no_window, "x", Some(2)));
    assert!(back.layers.iter().filter_map(|l| l.op.block_dims()).all(|b| b.window == 0));
}

#[test]
fn deepseeks_routing_and_dense_first_blocks_are_emitted_for_megatron_and_read_back() {
    // a DeepSeek-V3 in miniature: one dense block, then mixtures of 8 experts with a shared
    // one, sigmoid scores with a fixed expert bias, 2 of 4 groups, weights scaled by 2.5
    use pipec_grammar::import::megatron;
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let plain = "    - repeat 2: transformer_block(d=64, heads=4, ff=172, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)";
    assert!(text.contains(plain), "specs/llama-tiny.yaml's block changed");
    let attention = "d=64, heads=4, causal=true, head_dim=16, kv_lora=32, q_lora=48, rope_dim=8, v_head_dim=16, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false";
    let routing = "experts=8, top_k=4, shared_experts=1, router=sigmoid, route_scale=2.5, route_groups=4, route_group_top=2, expert_bias=true";
    let blocks = format!(
        "    - repeat 1: transformer_block({attention}, ff=172)\n    - repeat 3: transformer_block({attention}, ff=32, {routing})"
    );
    let plan = plan_of(&text.replacen(plain, &blocks, 1).replacen("stages: \"1-1\"", "stages: \"2\"", 1));
    let shape = plan.gpt_shape().expect("dense blocks first, then experts: a language model");
    assert_eq!((shape.layers, shape.dense, shape.dense_ff, shape.block.ff), (4, 1, 172, 32));
    let m = shape.moe().expect("experts");
    assert_eq!((m.groups, m.group_top, m.scale, m.expert_bias), (4, 2, 2.5, true));
    let files = pipec_plan::engine::emit::emit(&plan, &EngineTarget::newest(Engine::Megatron)).expect("megatron");
    let file = |name: &str| files.iter().find(|(f, _)| f == name).map(|(_, t)| t.clone()).expect("emitted");
    let args = file("args.txt");
    for f in [
        "--ffn-hidden-size 172",
        "--moe-ffn-hidden-size 32",
        "--moe-layer-freq \"([0]*1+[1]*3)\"",
        "--moe-router-score-function sigmoid",
        "--moe-router-topk-scaling-factor 2.5",
        "--moe-router-num-groups 4",
        "--moe-router-group-topk 2",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate 0",
    ] {
        assert!(args.contains(f), "{f}: {args}");
    }
    // the script quotes the pattern for the shell, and the import reads both back
    assert!(file("train.sh").contains("--moe-layer-freq \"([0]*1+[1]*3)\""));
    for text in [args.clone(), file("train.sh")] {
        let back = imported_plan(megatron::import(&text, "back", Some(plan.devices.len())));
        assert_eq!(back.gpt_shape(), Some(shape), "{text}");
    }
    // Megatron-LM moves its expert bias after every step unless the rate is 0; another
    // pattern of dense and expert blocks than dense-first is refused by name
    let moving = args.replace("--moe-router-bias-update-rate 0", "--moe-router-bias-update-rate 1e-3");
    let e = megatron::import(&moving, "back", Some(2)).expect_err("a moving bias");
    assert!(e.contains("pipec's expert bias is fixed"), "{e}");
    let alternating = args.replace("\"([0]*1+[1]*3)\"", "\"([0]*1+[1]*1)*2\"");
    let e = megatron::import(&alternating, "back", Some(2)).expect_err("alternating");
    assert!(e.contains("--moe-layer-freq"), "{e}");
    // sigmoid scores Megatron-LM always renormalises: not renormalised is refused
    let unnormalised =
        plan_of(
            &text
                .replacen(plain, &blocks.replace("router=sigmoid, ", "router=sigmoid, norm_topk=false, "), 1)
                .replacen("stages: \"1-1\"", "stages: \"2\"", 1),
        );
    let e = pipec_plan::engine::emit::emit(&unnormalised, &EngineTarget::newest(Engine::Megatron))
        .expect_err("no flag for it");
    assert!(e.contains("norm_topk=false"), "{e}");
}

/// A llama-tiny of `blocks` blocks on `devices` devices, for Megatron-LM, with `strategy`.
fn tiny_for_megatron(blocks: usize, devices: usize, strategy: &str) -> String {
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let text = text
        .replace("repeat 2:", &format!("repeat {blocks}:"))
        .replace("devices_per_node: 2", &format!("devices_per_node: {devices}"));
    for_engine(&text, Engine::Megatron, strategy)
}

/// Megatron-LM's uneven split: a plan for Megatron-LM whose blocks do not divide its chunks
/// is split as Megatron-LM splits it, counting the embedding and the loss as a layer of the
/// first and last chunk (6 blocks over 4 stages: 1, 2, 2, 1), `pipec emit` writes both
/// flags, and `pipec import` of what it wrote gives back the same chunks. A written
/// partition Megatron-LM cannot run is refused before compiling.
#[test]
fn megatron_counts_the_embedding_and_the_loss_in_its_uneven_split() {
    use pipec_grammar::import::megatron;
    let text = tiny_for_megatron(6, 4, "strategy:\n  stages: \"1-1-1-1\"\n  schedule: 1f1b\n  microbatches: 4");
    let plan = plan_of(&text);
    assert_eq!(plan.engine_layout().chunk_blocks, Some(vec![1, 2, 2, 1]));
    let files = pipec_plan::engine::emit::emit(&plan, &plan.engine).expect("megatron runs it");
    let args = files.iter().find(|(f, _)| f == "args.txt").map(|(_, t)| t.clone()).expect("args.txt");
    for flag in ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"] {
        assert!(args.contains(flag), "{flag} in\n{args}");
    }
    let back = imported_plan(megatron::import(&args, "tiny", Some(4)));
    assert_eq!(back.engine_layout().chunk_blocks, Some(vec![1, 2, 2, 1]));
    // the embedding alone counted: 7 blocks, 1, 2, 2, 2 (the compiler's own split of 7 would
    // count the loss: 2, 2, 2, 1)
    let seven = args.replace("--num-layers 6", "--num-layers 7").replace("--account-for-loss-in-pipeline-split", "");
    let back = imported_plan(megatron::import(&seven, "tiny", Some(4)));
    assert_eq!(back.engine_layout().chunk_blocks, Some(vec![1, 2, 2, 2]));
    // the first and the last rank's blocks given (`--decoder-first/last-pipeline-num-layers`),
    // the rest shared evenly: 2, 1, 1, 2 (Megatron-LM's transformer_block.py)
    let ends = args
        .replace("--account-for-embedding-in-pipeline-split", "--decoder-first-pipeline-num-layers 2")
        .replace("--account-for-loss-in-pipeline-split", "--decoder-last-pipeline-num-layers 2");
    let back = imported_plan(megatron::import(&ends, "tiny", Some(4)));
    assert_eq!(back.engine_layout().chunk_blocks, Some(vec![2, 1, 1, 2]));
    let uneven = pipec_plan::engine::capability::megatron_uneven_ranks;
    assert_eq!(uneven(14, 4, 2, (Some(2), None)), Ok(vec![1, 2, 2, 2, 1, 2, 2, 2]));
    assert!(uneven(12, 4, 1, (Some(2), None)).expect_err("10 over 3").contains("3 other ranks"));
    assert!(uneven(8, 2, 2, (Some(3), None)).expect_err("3 over 2").contains("virtual stages"));
    let own =
        plan_of(&tiny_for_megatron(7, 4, "strategy:\n  stages: \"1-1-1-1\"\n  schedule: 1f1b\n  microbatches: 4"));
    assert_eq!(own.engine_layout().chunk_blocks, Some(vec![2, 2, 2, 1]));
    // a written split no even one describes (2, 1, 2, 1): written layer by layer
    // (`--pipeline-model-parallel-layout`) and read back as the same partition
    let written = plan_of(&tiny_for_megatron(
        6,
        4,
        "strategy:\n  stages: \"1-1-1-1\"\n  schedule: 1f1b\n  microbatches: 4\n  partition: [\"0..3\", \"3..4\", \"4..6\", \"6..9\"]",
    ));
    let files = pipec_plan::engine::emit::emit(&written, &written.engine).expect("megatron runs it");
    let args = files.iter().find(|(f, _)| f == "args.txt").map(|(_, t)| t.clone()).expect("args.txt");
    assert!(args.contains("--pipeline-model-parallel-layout \"Ett|t|tt|tL\""), "{args}");
    assert!(!args.contains("--account-for"), "{args}");
    let back = imported_plan(megatron::import(&args, "tiny", Some(4)));
    assert_eq!(back.engine_layout().chunk_blocks, Some(vec![2, 1, 2, 1]));
}

/// Expert tensor parallelism: `etp: 1` is written for Megatron-LM as
/// `--expert-tensor-parallel-size 1` with `--expert-model-parallel-size` the group's devices
/// and read back as the same layout; experts split like the block are written with the
/// tensor-parallel degree (before, emit wrote 1 whatever the plan, and Megatron-LM would have
/// folded the ranks). DeepSpeed, whose AutoEP only folds, refuses split experts.
/// (torchtitan's flavours have no experts to write.)
#[test]
fn expert_tensor_parallelism_is_written_and_read_back_by_megatron() {
    use pipec_grammar::import::megatron;
    let text = std::fs::read_to_string(root().join("specs/moe-tiny.yaml")).expect("example");
    let strategy = |etp: &str| {
        let ep = if etp.is_empty() { 2 } else { 4 };
        format!("strategy:\n  dp: 2\n  tp: 2\n  sequence_parallel: true\n  schedule: dp-only\n  microbatches: 2\n  zero: 1\n  ep: {ep}{etp}")
    };
    for whole in [true, false] {
        let etp = if whole { "\n  etp: 1" } else { "" };
        let plan = plan_of(&for_engine(&text, Engine::Megatron, &strategy(etp)));
        let layout = plan.engine_layout();
        assert_eq!((layout.ep, layout.etp), if whole { (4, 1) } else { (2, 2) }, "{whole}");
        assert_eq!(plan.schedule.whole_experts, whole);
        let files = pipec_plan::engine::emit::emit(&plan, &plan.engine).expect("megatron runs it");
        let args = files.iter().find(|(f, _)| f == "args.txt").map(|(_, t)| t.clone()).expect("args.txt");
        assert!(args.contains(&format!("--expert-tensor-parallel-size {}", layout.etp)), "{args}");
        assert!(args.contains(&format!("--expert-model-parallel-size {}", layout.ep)), "{args}");
        let back = imported_plan(megatron::import(&args, "moe", Some(4)));
        assert_eq!((back.engine_layout().ep, back.engine_layout().etp), (layout.ep, layout.etp), "{whole}");
        assert_eq!(back.schedule.whole_experts, whole);
    }
    let split = plan_of(&for_engine(&text, Engine::Pipec, &strategy("")));
    let why = pipec_plan::engine::emit::emit(&split, &EngineTarget::newest(Engine::Deepspeed)).expect_err("folds only");
    assert!(why.contains("`etp`"), "{why}");
}

/// A pipeline whose first stage holds only dense blocks (DeepSeek-V3's dense blocks first):
/// the engines are told the expert stages' degree, not the first stage's 1.
#[test]
fn the_expert_parallel_degree_is_the_expert_stages_when_the_first_has_none() {
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example").replace(
        "    - repeat 2: transformer_block(d=64, heads=4, ff=172, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)\n",
        "    - repeat 2: transformer_block(d=64, heads=4, ff=172, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)\n    - repeat 2: transformer_block(d=64, heads=4, ff=32, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, experts=4, top_k=2)\n",
    ).replace("devices_per_node: 2", "devices_per_node: 4");
    let plan = plan_of(&for_engine(
        &text,
        Engine::Megatron,
        "strategy:\n  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: 1\n  ep: 2",
    ));
    assert_eq!(plan.engine_layout().chunk_blocks, Some(vec![2, 2]));
    assert_eq!(plan.stages[0].expert_parallel, 1, "the first stage holds the dense blocks");
    assert_eq!(plan.engine_layout().ep, 2);
    let files = pipec_plan::engine::emit::emit(&plan, &plan.engine).expect("megatron runs it");
    let args = files.iter().find(|(f, _)| f == "args.txt").map(|(_, t)| t.clone()).expect("args.txt");
    assert!(args.contains("--expert-model-parallel-size 2"), "{args}");
}

/// DeepSeek-V3's multi-token prediction (`model.mtp`) crosses to Megatron-LM and back: its
/// modules and loss weight as `--mtp-num-layers` and `--mtp-loss-scaling-factor`; a chunk
/// split no even one describes (the embedding alone with a block, the last chunk the
/// modules and the loss, as Megatron-Bridge's DeepSeek-V3 recipe) as
/// `--pipeline-model-parallel-layout`, read back into the same partition; the layout's
/// language with its repetitions; torchtitan and DeepSpeed refuse the modules at the key.
#[test]
fn multi_token_prediction_and_a_written_layout_cross_to_megatron_and_back() {
    use pipec_grammar::import::megatron;
    use pipec_plan::engine::capability::{megatron_layout, parse_megatron_layout};
    let text = std::fs::read_to_string(root().join("specs/llama-tiny.yaml")).expect("example");
    let text = text
        .replacen("  loss: cross_entropy\n", "  loss: cross_entropy\n  mtp: { depth: 1, weight: 0.3 }\n", 1)
        .replacen("  partition: balanced\n", "  partition: [\"0..3\", \"3..5\"]\n", 1);
    assert!(text.contains("mtp: {") && text.contains("\"3..5\""), "{text}");
    let plan = plan_of(&format!("engine: megatron\n{text}"));
    assert_eq!(plan.model.mtp, Some(pipec_plan::model::Mtp { depth: 1, weight: 0.3 }));
    let files = pipec_plan::engine::emit::emit(&plan, &EngineTarget::newest(Engine::Megatron)).expect("emits");
    let args = files.into_iter().find(|(f, _)| f == "args.txt").map(|(_, t)| t).expect("args.txt");
    assert!(args.contains("--mtp-num-layers 1") && args.contains("--mtp-loss-scaling-factor 0.3"), "{args}");
    // both blocks in the first chunk, the modules and the loss alone in the last: no even
    // split, with or without the ends counted
    assert!(args.contains("--pipeline-model-parallel-layout \"Ett|mL\""), "{args}");
    assert!(!args.contains("--num-virtual-stages-per-pipeline-rank"), "{args}");
    let back = imported_plan(megatron::import(&args, "back", Some(plan.devices.len())));
    assert_eq!(back.model.mtp, plan.model.mtp);
    let ranges = |p: &Plan| p.stages.iter().map(|s| s.layers).collect::<Vec<_>>();
    assert_eq!(ranges(&back), ranges(&plan));
    // the layout's language: Megatron-Bridge's DeepSeek-V3 layout, and refusals by name
    assert_eq!(parse_megatron_layout("Et|(tt|)*30mL"), Ok((std::iter::once(1).chain([2; 30]).chain([0]).collect(), 1)));
    assert_eq!(parse_megatron_layout("Et*3,|t*2L"), Ok((vec![3, 2], 0)));
    assert_eq!(megatron_layout(&[1, 2, 0], 1), "Et|tt|mL");
    assert!(parse_megatron_layout("tt|EL").expect_err("no embedding first").contains("embedding"));
    assert!(parse_megatron_layout("Etm|tL").expect_err("a module before a block").contains("`m`"));
    assert!(parse_megatron_layout("E(t|)*99999999999L").expect_err("too long").contains("unrolls past"));
    for engine in ["torchtitan", "deepspeed"] {
        let refused = pipec_grammar::check_source(&format!("engine: {engine}\n{text}"));
        assert!(
            refused.diagnostics.iter().any(|d| d.code == "E0702" && d.message.contains("multi-token prediction")),
            "{engine}: {:?}",
            refused.diagnostics.iter().map(|d| &d.message).collect::<Vec<_>>()
        );
    }
}

/// torchtitan's `[compile] components`: a compiled loss keeps the bf16 logits and writes
/// their gradient in one kernel, where the eager loss keeps fp32 log-probabilities beside
/// two fp32 gradients in its backward, and PyTorch's loss parallel (the vocabulary split
/// by tensor parallelism) three (`pipec_plan::engine::performance::CrossEntropy`). The spec
/// says which (`compile: [model]`, `true`), the plan prices it to the byte, `pipec emit`
/// writes the components and the import reads them back.
#[test]
fn the_loss_torchtitan_compiles_is_priced_emitted_and_read_back() {
    use pipec_grammar::import::torchtitan;
    let job = std::fs::read_to_string(root().join("tests/engines/published/torchtitan-llama3-8b.toml")).expect("toml");
    let spec = torchtitan::import(&job, "tt8", Some(8)).expect("imports");
    assert!(spec.contains("\nengine: torchtitan\n"), "no [compile] section: eager\n{spec}");
    let with = |engine: &str, tp: usize| {
        let t = spec.replacen("\nengine: torchtitan\n", &format!("\nengine: {engine}\n"), 1);
        let t = t.replacen("  dp: 8\n", &format!("  dp: {}\n", 8 / tp), 1).replacen(
            "  tp: 1\n",
            &format!("  tp: {tp}\n{}", if tp > 1 { "  sequence_parallel: true\n" } else { "" }),
            1,
        );
        plan_of(&t)
    };
    // one sequence of 8192 tokens a device, scored over 128,256 words
    let logits = 8192u64 * 128_256;
    let memory = |p: &Plan| {
        let m = &p.devices[0].memory;
        (m.activations, m.transient)
    };
    let eager = with("torchtitan", 1);
    let blocks = with("{ name: torchtitan, compile: [model] }", 1);
    let whole = with("{ name: torchtitan, compile: true }", 1);
    assert_eq!(memory(&eager), memory(&blocks), "compiled blocks leave the eager loss as it is");
    // and the bf16 logits' freed block, which the caching allocator keeps reserved
    assert_eq!(memory(&eager).1, 10 * logits, "two fp32 gradients beside the log-probabilities");
    assert_eq!(memory(&whole).1, 2 * logits, "the gradient at the logits' precision");
    assert_eq!(memory(&eager).0 - memory(&whole).0, 2 * logits, "bf16 logits kept, not fp32 log-probabilities");
    // the vocabulary split over 2 ranks: loss parallel's three fp32 tensors, and the logits'
    // reserved block
    let split = with("{ name: torchtitan, compile: [model] }", 2);
    assert_eq!(memory(&split).1, 14 * logits / 2);
    // emitted as planned, and read back
    let emitted = |plan: &Plan| -> String {
        let files = pipec_plan::engine::emit::emit(plan, &EngineTarget::newest(Engine::Torchtitan)).expect("emits");
        files.into_iter().find(|(f, _)| f == "job.toml").map(|(_, t)| t).expect("job.toml")
    };
    for (plan, components, written) in
        [(&blocks, "[\"model\"]", "compile: [model]"), (&whole, "[\"model\", \"loss\"]", "compile: [model, loss]")]
    {
        let job = emitted(plan);
        assert!(job.contains(&format!("components = {components}")), "{job}");
        let back = torchtitan::import(&job, "back", Some(8)).expect("reads back");
        assert!(back.contains(written), "{back}");
    }
    assert!(emitted(&eager).contains("enable = false"));
}

/// Llama-like blocks on 8 nodes of 2 H100s under `strategy` (its degrees, and the rest),
/// so that every gradient reduction crosses InfiniBand.
fn reduced_across_nodes(engine: &str, strategy: &str) -> Plan {
    let text = format!(
        "name: buckets\nengine: {engine}\nmodel:\n  input: [2048]\n  layers:\n    - embedding(32000, 2048)\n    - repeat 8: transformer_block(d=2048, heads=16, ff=5632, causal=true, norm=rmsnorm, mlp=swiglu, bias=false)\n    - rmsnorm\n    - linear(2048, 32000, bias=false)\n  loss: cross_entropy\n  attention: flash\ncluster:\n  nodes: 8\n  devices_per_node: 2\n  device: h100-sxm\n  links: dgx-h100\nstrategy:\n  pp: 1\n  schedule: 1f1b\n  microbatches: 16\n{strategy}training:\n  batch_size: 16\n  steps: 1\n  optimizer: {{ kind: adamw, lr: 0.001 }}\n  precision: bf16\n"
    );
    plan_of(&text)
}

#[test]
fn each_engine_reduces_its_gradients_in_its_own_buckets_during_the_backward() {
    let exposed = |p: &Plan| p.simulation.devices.iter().map(|d| d.exposed_collective_s).fold(0.0, f64::max);
    // Megatron-FSDP and FSDP2 reduce-scatter each block after its backward: of the last
    // microbatch's reduction only what follows the backward is exposed, against the whole
    // of it with the reduction after the backward (`overlap: false`)
    for engine in ["megatron", "torchtitan"] {
        let per_block = reduced_across_nodes(engine, "  dp: 8\n  tp: 2\n  sequence_parallel: true\n  zero: 3\n");
        let after =
            reduced_across_nodes(engine, "  dp: 8\n  tp: 2\n  sequence_parallel: true\n  zero: 3\n  overlap: false\n");
        let (hidden, whole) = (exposed(&per_block), exposed(&after));
        assert!(whole > 0.0 && hidden < whole / 2.0, "{engine}: {hidden} s exposed against {whole} s");
        assert!(per_block.simulation.step_time_s < after.simulation.step_time_s, "{engine}");
        // the engine's buckets price the plan; the plan declares none for pipec's executor
        assert!(per_block.stages.iter().all(|s| s.gradient_buckets.is_empty()), "{engine}");
    }
    // torchtitan's DDP buckets 100 MiB: a model of 0.5 B parameters is several
    // buckets, which hide part of the all-reduce
    let ddp = reduced_across_nodes("torchtitan", "  dp: 16\n  tp: 1\n  zero: 0\n");
    let ddp_after = reduced_across_nodes("torchtitan", "  dp: 16\n  tp: 1\n  zero: 0\n  overlap: false\n");
    assert!(exposed(&ddp) < exposed(&ddp_after), "{} against {}", exposed(&ddp), exposed(&ddp_after));
    // pipec's executor buckets only where the spec writes `bucket`, and the plan declares
    // those buckets for it to run
    let pipec = reduced_across_nodes("pipec", "  dp: 16\n  tp: 1\n  zero: 3\n");
    let bucketed = reduced_across_nodes("pipec", "  dp: 16\n  tp: 1\n  zero: 3\n  bucket: 64MiB\n");
    assert!(pipec.stages.iter().all(|s| s.gradient_buckets.is_empty()));
    assert!(bucketed.stages.iter().all(|s| s.gradient_buckets.len() > 1));
    assert!(exposed(&bucketed) < exposed(&pipec), "{} against {}", exposed(&bucketed), exposed(&pipec));
}

/// FP8 training's storage defaults to the spec's engine's kernels: a torchtitan run that
/// writes only `precision: fp8` is planned as torchao's `Float8Linear` runs it (bf16 inputs
/// kept, no FP8 weight copies: the published run's own `fp8` line), a Megatron-LM one as
/// Transformer Engine does (FP8 inputs, the weight copies kept); the importers read the same.
#[test]
fn fp8_storage_defaults_to_the_engines_kernels() {
    use pipec_plan::plan::Fp8Plan;
    use pipec_plan::vocab::Fp8Recipe;
    let published = |run: &str| {
        std::fs::read_to_string(root().join(format!("bench/specs/published-2025/{run}.yaml"))).expect("the spec")
    };
    let torchtitan = published("tt24-t1-8b-8g-fp8-compile");
    let written = plan_of(&torchtitan);
    let bare =
        plan_of(&torchtitan.replace("  fp8: { recipe: tensorwise, activations: bf16, weight_copies: false }\n", ""));
    assert_eq!(bare.training.fp8, written.training.fp8, "torchao's storage, as the published run writes it");
    assert_eq!(bare.training.fp8, Some(Fp8Plan::of_engine(Engine::Torchtitan, Fp8Recipe::Tensorwise)));
    assert_eq!(bare.devices[0].memory.total, written.devices[0].memory.total);
    let megatron = plan_of(&published("mb2511-h100-llama38b-fp8cs-8g"));
    let f = megatron.training.fp8.expect("FP8");
    assert!(f.weight_copies && f.activations == pipec_plan::vocab::Fp8Storage::Fp8, "{f:?}");
    assert_eq!(Some(f), Some(Fp8Plan::of_engine(Engine::Megatron, Fp8Recipe::Tensorwise)));
}
