//! The memory strategies of the strategy section: ZeRO's sharding across data-parallel
//! replicas (its paper's per-device model-state formulas, exactly), and E0601's hints naming
//! a sharding level, flash attention or a context-parallel ring only when it makes the plan fit.

use std::path::Path;

use pipec_compiler::{compile, CompileOptions, CompileResult};

fn compile_text(text: &str) -> CompileResult {
    let checked = pipec_grammar::check_source(text);
    let errors: Vec<String> = checked.diagnostics.iter().filter(|d| d.is_error()).map(|d| d.message.clone()).collect();
    let spec = checked.spec.unwrap_or_else(|| panic!("the spec is valid: {errors:?}"));
    compile(&spec, &CompileOptions::default())
}

/// Ψ parameters in four bias-free 1024 × 1024 products and a 1024 × 16 head, on `d`
/// data-parallel replicas, bf16 weights and gradients, Adam (K = 12: fp32 master weights and
/// two fp32 moments).
fn mlp(d: usize, zero: Option<u8>) -> String {
    let zero = zero.map_or(String::new(), |z| format!("\n  zero: {z}"));
    format!(
        "name: zero
model:
  input: [1024]
  layers:
    - repeat 4: linear(1024, 1024, bias=false)
    - linear(1024, 16, bias=false)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: {d}
  device: a100-80gb
  links: dgx-a100
strategy:
  stages: \"{d}\"
  schedule: dp-only
  microbatches: {d}{zero}
training:
  batch_size: {d}
  steps: 1
  optimizer: {{ kind: adam, lr: 0.001 }}
  precision: bf16
  grad_precision: bf16
"
    )
}

const PSI: u64 = 4 * 1024 * 1024 + 1024 * 16;

#[test]
fn zero_stages_hold_the_zero_papers_model_state_per_device() {
    for d in [2u64, 4, 8] {
        for zero in [None, Some(0), Some(1), Some(2), Some(3)] {
            let plan = compile_text(&mlp(d as usize, zero)).into_compiled().expect("compiles").plan;
            let level = zero.unwrap_or(0);
            for device in &plan.devices {
                let m = &device.memory;
                let shard = |bytes: u64, sharded: bool| if sharded { bytes.div_ceil(d) } else { bytes };
                // stage 0: 2Ψ + 2Ψ + KΨ; 1: 2Ψ + 2Ψ + KΨ/d; 2: 2Ψ + (2 + K)Ψ/d; 3: (4 + K)Ψ/d,
                // except that at stage 3 pipec's executor (as FSDP2) keeps no bf16 shard: its
                // fp32 master shard is the weights, (2 + K)Ψ/d in all (Megatron-FSDP and
                // DeepSpeed keep both: tests/compile.rs)
                let (weights, optimizer) = if level >= 3 { (4 * PSI, 8 * PSI) } else { (2 * PSI, 12 * PSI) };
                assert_eq!(m.weights, shard(weights, level >= 3), "weights, d {d} zero {level}");
                assert_eq!(m.gradients, shard(2 * PSI, level >= 2), "gradients, d {d} zero {level}");
                assert_eq!(m.optimizer, shard(optimizer, level >= 1), "optimizer, d {d} zero {level}");
            }
            assert_eq!(plan.schedule.sharding.level(), level);
        }
    }
}

#[test]
fn zero_2_and_3_count_the_whole_gradient_each_reduce_scatter_takes() {
    // ZeRO-2/3 keep a shard of the summed gradient, but the backward computes whole
    // gradients before each reduce-scatter takes them: the stage's whole gradient (2Ψ) in
    // one, or the largest of its gradient buckets
    let buffers = |zero: u8, bucket: &str| {
        let text = mlp(4, Some(zero)).replace("microbatches: 4", &format!("microbatches: 4{bucket}"));
        let plan = compile_text(&text).into_compiled().expect("compiles").plan;
        let m = &plan.devices[0].memory;
        let largest = plan.stages[0].gradient_buckets.iter().map(|b| b.bytes).max();
        (m.buffers, m.total - m.buffers, largest)
    };
    let (one, _, _) = buffers(1, "");
    let (two, _, _) = buffers(2, "");
    assert_eq!(two - one, 2 * PSI, "ZeRO-2 without buckets holds the whole bf16 gradient");
    let (one_b, _, none) = buffers(1, "\n  bucket: 4MiB");
    assert_eq!(none, Some(4 * 1024 * 1024 + 2 * 1024 * 16), "two 2 MiB layers to a bucket, the head with the last two");
    let (two_b, _, largest) = buffers(2, "\n  bucket: 4MiB");
    assert_eq!(one_b, one, "ZeRO-1 keeps the whole gradient as its gradients already");
    assert_eq!(two_b - one_b, largest.expect("buckets"), "ZeRO-2 with buckets holds the largest bucket");
    // ZeRO-3 gathers the layers outside transformer blocks as one unit (FSDP's root unit,
    // as torchtitan wraps them), held whole through the forward and backward, and its
    // backward's whole bf16 gradient is what its reduce-scatter takes, in place of a bucket
    let (three_b, _, _) = buffers(3, "\n  bucket: 4MiB");
    assert_eq!(
        three_b - two_b + largest.expect("buckets"),
        2 * PSI + 2 * PSI,
        "the root unit gathered, its gradient whole"
    );
}

#[test]
fn sharding_the_weights_costs_gathers_sharding_the_optimizer_does_not() {
    // one device per node: the replicas gather over InfiniBand, slower than the compute
    let step = |zero: u8| {
        let text = mlp(8, Some(zero)).replace("nodes: 1\n  devices_per_node: 8", "nodes: 8\n  devices_per_node: 1");
        let compiled = compile_text(&text).into_compiled().expect("compiles");
        compiled.plan.simulation.step_time_s
    };
    let (z0, z1, z2, z3) = (step(0), step(1), step(2), step(3));
    // ZeRO-1 reduce-scatters and all-gathers the bytes an all-reduce moves, and each replica
    // updates an eighth of the weights
    assert!(z1 < z0, "zero 1 {z1} against {z0}");
    // ZeRO-3 gathers every layer's weights before each forward and backward, where ZeRO-2
    // gathers them once after the update
    assert!(z3 > z2, "zero 3 {z3} against zero 2 {z2}");
}

#[test]
fn zero_2_gradient_buckets_hide_the_last_reduce_scatter_behind_the_backward() {
    // one device per node: each reduce-scatter crosses InfiniBand. Without buckets the
    // step's last one starts after the last backward; with them, all but the last bucket's
    // run during it
    let step = |bucket: &str| {
        let text = mlp(8, Some(2))
            .replace("nodes: 1\n  devices_per_node: 8", "nodes: 8\n  devices_per_node: 1")
            .replace("microbatches: 8", &format!("microbatches: 8{bucket}"));
        let compiled = compile_text(&text).into_compiled().expect("compiles");
        let plan = compiled.plan;
        (plan.simulation.step_time_s, plan.stages[0].gradient_buckets.len())
    };
    let (whole, none) = step("");
    let (bucketed, n) = step("\n  bucket: 4MiB");
    assert_eq!((none, n), (0, 2));
    assert!(bucketed < whole, "bucketed {bucketed} s against {whole} s");
}

#[test]
fn zero_without_a_replicated_stage_is_e0414() {
    let text = mlp(2, Some(1)).replace("stages: \"2\"", "stages: \"1-1\"").replace("dp-only", "1f1b");
    let checked = pipec_grammar::check_source(&text);
    let codes: Vec<&str> = checked.diagnostics.iter().map(|d| d.code).collect();
    assert!(codes.contains(&"E0414"), "{codes:?}");
    let text = mlp(2, Some(4));
    let checked = pipec_grammar::check_source(&text);
    assert!(checked.diagnostics.iter().any(|d| d.code == "E0105" && d.message.contains("0 to 3")));
}

fn gpt3(extra_strategy: &str, attention: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/specs/gpt3-175b-128.yaml");
    std::fs::read_to_string(path)
        .expect("the GPT-3 spec")
        .replace("  recompute: false\n", &format!("  recompute: false\n{extra_strategy}"))
        .replace("  loss: cross_entropy\n", &format!("  loss: cross_entropy\n{attention}"))
}

/// GPT-3 175B on 128 A100 80 GB with Megatron-LM's published layout (t 4, p 8, interleaved,
/// d 4, bf16, no recompute): rejected without a memory strategy, with E0601 naming what
/// fits; accepted with the distributed optimizer and flash attention.
#[test]
fn the_published_gpt3_layout_fits_with_the_distributed_optimizer_and_flash_attention() {
    let rejected = compile_text(&gpt3("", ""));
    let e0601 = rejected.diagnostics.iter().find(|d| d.code == "E0601").expect("E0601 without a memory strategy");
    let help = e0601.help.clone().unwrap_or_default();
    assert!(help.contains("`zero: 1` with `attention: flash`"), "{help}");
    // full recompute alone leaves it at about 100 GiB: not offered
    assert!(!help.contains("`recompute: true`"), "{help}");

    let accepted = compile_text(&gpt3("  zero: 1\n", "  attention: flash\n"));
    assert!(!accepted.has_errors(), "{:?}", accepted.diagnostics);
    let plan = accepted.into_compiled().expect("compiles").plan;
    for d in &plan.devices {
        assert!(d.memory.total <= d.memory.capacity, "{}: {:?}", d.id, d.memory);
    }
    // each alone does not fit
    for (zero, attention) in [("  zero: 1\n", ""), ("", "  attention: flash\n")] {
        let r = compile_text(&gpt3(zero, attention));
        assert!(r.diagnostics.iter().any(|d| d.code == "E0601"), "{zero}{attention}");
    }
}

/// The same model and cluster with the layout left to the search (sequence parallelism and
/// flash attention as written): it shards the optimizer state itself, and its plan is at
/// least as fast as the published layout under pipec's model.
#[test]
fn the_search_on_the_gpt3_cluster_finds_a_plan_at_least_as_fast_as_the_published_one() {
    use pipec_compiler::search::{search, SearchOptions};
    let published = gpt3("  zero: 1\n", "  attention: flash\n");
    let published_step = compile_text(&published).into_compiled().expect("compiles").plan.simulation.step_time_s;
    let strategy_start = published.find("strategy:").expect("strategy");
    let strategy_end = published.find("training:").expect("training");
    let auto = format!(
        "{}strategy: {{ tp: auto, pp: auto, dp: auto, schedule: auto, microbatches: auto, recompute: auto, sequence_parallel: true }}\n{}",
        &published[..strategy_start],
        &published[strategy_end..]
    );
    let spec = pipec_grammar::check_source(&auto).spec.expect("the auto spec is valid");
    let options = SearchOptions::from_spec(&spec, spec.strategy.auto.as_ref().expect("auto"));
    let report = search(&auto, &spec, &CompileOptions::default(), &options);
    let ranked = report.ranked(options.headroom);
    let &(best, prediction) = ranked.first().expect("a plan that fits");
    let chosen = &report.candidates[best];
    assert!(
        prediction.step_s <= published_step,
        "{} s against the published layout's {published_step} s",
        prediction.step_s
    );
    // the optimizer state sharded (ZeRO 1 or above), by the search itself
    assert!(chosen.sharding.shards().0, "{}", chosen.strategy());
    assert!(chosen.strategy().contains("sequence_parallel: true"), "{}", chosen.strategy());
    // with `tp_overlap` written, every tensor-parallel candidate keeps it, and the best plan
    // is at least as fast as without it
    let overlapped = auto.replace("sequence_parallel: true }", "sequence_parallel: true, tp_overlap: true }");
    let spec = pipec_grammar::check_source(&overlapped).spec.expect("the auto spec is valid");
    let options = SearchOptions::from_spec(&spec, spec.strategy.auto.as_ref().expect("auto"));
    let report = search(&overlapped, &spec, &CompileOptions::default(), &options);
    let &(best, faster) = report.ranked(options.headroom).first().expect("a plan that fits");
    let chosen = &report.candidates[best];
    assert!(chosen.tp > 1 && chosen.strategy().contains("tp_overlap: true"), "{}", chosen.strategy());
    assert!(
        faster.step_s <= prediction.step_s,
        "{} s against {} s without the overlap",
        faster.step_s,
        prediction.step_s
    );
}

/// Tensor parallelism divides only what it splits: the small CNN's convolutions (which it
/// replicates) keep their time and weights at tp 2, while the linear pair (column- then
/// row-parallel) halves its products' weights and time.
#[test]
fn tensor_parallelism_divides_only_what_it_splits() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/cnn.yaml");
    let text = std::fs::read_to_string(path).expect("the CNN spec");
    let layers = |tp: usize| {
        // one stage, so that the linear pair is in it (without the dropout between them,
        // which the pairing rule does not cross)
        let text = text
            .replace("linear(4096, 128) -> relu -> dropout(0.1)", "linear(4096, 128) -> relu")
            .replace("devices_per_node: 2", &format!("devices_per_node: {tp}"))
            .replace("  stages: \"1-1\"\n", &format!("  stages: \"1\"\n  tp: {tp}\n"));
        compile_text(&text).into_compiled().expect("compiles").plan.layers
    };
    let (one, two) = (layers(1), layers(2));
    let (mut convs, mut splits) = (0, 0);
    for (a, b) in one.iter().zip(&two) {
        match a.op {
            pipec_plan::model::Op::Conv2d { .. } => {
                convs += 1;
                assert_eq!(a.forward_s, b.forward_s, "layer {}: a replicated conv's forward", a.index);
                assert_eq!(a.backward_s, b.backward_s, "layer {}: its backward", a.index);
                assert_eq!(a.parameter_bytes, b.parameter_bytes, "layer {}: its weights", a.index);
            }
            pipec_plan::model::Op::Linear { .. } => {
                splits += 1;
                assert!(
                    b.parameter_bytes * 2 <= a.parameter_bytes + 1024,
                    "layer {}: a split linear's weights",
                    a.index
                );
                assert!(b.forward_s < a.forward_s, "layer {}: a split linear's forward", a.index);
            }
            _ => {}
        }
    }
    assert_eq!((convs, splits), (3, 2));
}

/// `tp_overlap` (Megatron-LM's --tp-comm-overlap): a layer's tensor-parallel collectives run
/// under its own passes. On 100 MB/s the blocks' all-reduces are shorter than their passes
/// and vanish from the step; what stays is the embedding's, whose gather is far shorter than
/// its all-reduce: the step lies between a free link's and the in-line one, nearer the free.
/// On 1 MB/s the blocks' outlast their passes too and only the passes' time is taken off.
/// `tp: 1` with it is E0423.
#[test]
fn tp_overlap_hides_each_layers_collectives_under_its_passes() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/tp-cpu.yaml");
    let text = std::fs::read_to_string(path).expect("the tensor-parallel spec");
    let link = "    intra_node: { bandwidth: 10GB/s, latency: 5us }";
    assert!(text.contains(link) && text.contains("  tp: 2\n"));
    let step = |overlap: bool, bandwidth: &str| {
        let t = text
            .replace("  tp: 2\n", if overlap { "  tp: 2\n  tp_overlap: true\n" } else { "  tp: 2\n" })
            .replace(link, &format!("    intra_node: {{ bandwidth: {bandwidth}, latency: 0us }}"));
        let plan = compile_text(&t).into_compiled().expect("compiles").plan;
        assert_eq!(plan.schedule.tp_overlap, overlap);
        plan.simulation.step_time_s
    };
    let free = step(false, "1000000TB/s");
    let (inline, hidden) = (step(false, "100MB/s"), step(true, "100MB/s"));
    assert!(inline > free * 1.2, "the collectives cost something in line: {inline} against {free}");
    assert!(free < hidden && hidden < inline, "{free} < {hidden} < {inline}");
    assert!(inline - hidden > 0.85 * (inline - free), "most of it hidden: {free} {hidden} {inline}");
    // a link slow enough that the blocks' collectives outlast their passes: the overlap
    // takes off at most the passes' time
    let (inline, partly) = (step(false, "1MB/s"), step(true, "1MB/s"));
    assert!(partly < inline && inline - partly <= free * 1.000001, "{free}: {partly} < {inline}");
    // `pipec run` says that the executor runs them in line
    let overlapped = compile_text(&text.replace("  tp: 2\n", "  tp: 2\n  tp_overlap: true\n"));
    let plan = overlapped.into_compiled().expect("compiles").plan;
    assert!(pipec_executor::caveats(&plan).iter().any(|c| c.contains("tp_overlap") && c.contains("in line")));
    let plain = compile_text(&text).into_compiled().expect("compiles").plan;
    assert!(!pipec_executor::caveats(&plain).iter().any(|c| c.contains("tp_overlap")));
    // sequence parallelism on pipec's executor: run, declared and priced as tensor
    // parallelism's sums on whole activations, so the plan is the one without it and
    // `pipec run` has nothing to say
    let sp = compile_text(&text.replace("  tp: 2\n", "  tp: 2\n  sequence_parallel: true\n"));
    let plan = sp.into_compiled().expect("compiles").plan;
    assert!(plan.schedule.sequence_parallel);
    assert!(plan.in_pass.lists.iter().flatten().all(|e| e.op == pipec_plan::PassOp::AllReduce), "{:?}", plan.in_pass);
    assert_eq!(plan.simulation.step_time_s, plain.simulation.step_time_s);
    let peaks = |p: &pipec_plan::Plan| p.devices.iter().map(|d| (d.id, d.memory.total)).collect::<Vec<_>>();
    assert_eq!(peaks(&plan), peaks(&plain));
    assert!(!pipec_executor::caveats(&plan).iter().any(|c| c.contains("sequence_parallel")));
    // priced for Megatron-LM's sequence parallelism (its gathers, its split activations):
    // `pipec run` says that the executor runs tensor parallelism's sums instead
    let gpt = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/gpt-tiny.yaml"))
        .expect("gpt-tiny")
        .replace("model:", "engine: megatron\nmodel:")
        .replace("stages: \"1-1\"", "stages: \"1\"\n  tp: 2\n  sequence_parallel: true");
    let plan = compile_text(&gpt).into_compiled().expect("compiles").plan;
    assert!(pipec_executor::caveats(&plan)
        .iter()
        .any(|c| c.contains("sequence_parallel") && c.contains("all-reduces")));
    // nothing to overlap without tensor parallelism
    let checked = pipec_grammar::check_source(&text.replace("  tp: 2\n", "  tp: 1\n  tp_overlap: true\n"));
    assert!(checked.diagnostics.iter().any(|d| d.code == "E0423"), "{:?}", checked.diagnostics);
}

/// `cp_comm: ring` against the all-gather: the ring keeps only a member's own keys and
/// values (less memory), hides its transfers under the attention core where the link is
/// fast enough, and on a slow link waits for twice the backward's bytes (the keys and
/// values around again beside their gradients).
#[test]
fn a_context_parallel_ring_keeps_less_and_hides_its_transfers_under_attention() {
    let text = |comm: &str, bandwidth: &str| {
        format!(
            "name: ring\nmodel:\n  input: [4096]\n  layers:\n    - embedding(512, 256)\n    - repeat 2: transformer_block(d=256, heads=4, ff=1024, causal=true)\n    - layernorm\n    - linear(256, 512, bias=false)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: {{ memory: 80GiB, throughput: 100TFLOP/s, memory_bandwidth: 2TB/s }}\n  links:\n    intra_node: {{ bandwidth: {bandwidth}, latency: 1us }}\nstrategy:\n  stages: \"1\"\n  schedule: gpipe\n  microbatches: 2\n  cp: 2\n{comm}training:\n  batch_size: 2\n  steps: 1\n  optimizer: {{ kind: adam, lr: 0.001 }}\n"
        )
    };
    let plan = |comm: &str, bandwidth: &str| {
        compile_text(&text(comm, bandwidth)).into_compiled().unwrap_or_else(|d| panic!("{d:?}")).plan
    };
    let ring_comm = "  cp_comm: ring\n";
    for bandwidth in ["1000GB/s", "1GB/s"] {
        let (gather, ring) = (plan("", bandwidth), plan(ring_comm, bandwidth));
        assert_eq!(ring.schedule.cp_comm, pipec_plan::vocab::CpComm::Ring);
        assert_eq!(gather.schedule.cp_comm, pipec_plan::vocab::CpComm::AllGather);
        let activations = |p: &pipec_plan::Plan| p.devices[0].memory.activations;
        assert!(activations(&ring) < activations(&gather), "{bandwidth}: the ring keeps no gathered keys and values");
        let [gf, gb] = gather.stages[0].context_s;
        let [rf, rb] = ring.stages[0].context_s;
        assert!(rf <= gf && gf > 0.0, "{bandwidth}: forward {rf} vs {gf}");
        if bandwidth == "1000GB/s" {
            // the transfers fit under the attention over the other block
            assert_eq!((rf, rb), (0.0, 0.0), "{bandwidth}");
            assert!(ring.simulation.step_time_s < gather.simulation.step_time_s);
        } else {
            // a slow link: the backward's twice the bytes outweigh the cover
            assert!(rb > gb, "{bandwidth}: backward {rb} vs {gb}");
        }
    }
    // `pipec run` says the executor's backward exchanges in line
    let caveats = pipec_executor::caveats(&plan(ring_comm, "1000GB/s"));
    assert!(caveats.iter().any(|c| c.contains("cp_comm: ring") && c.contains("in line")), "{caveats:?}");
    assert!(!pipec_executor::caveats(&plan("", "1000GB/s")).iter().any(|c| c.contains("cp_comm")));
    // a ring needs a context-parallel group
    let checked = pipec_grammar::check_source(&text(ring_comm, "1GB/s").replace("  cp: 2\n", ""));
    assert!(checked.diagnostics.iter().any(|d| d.code == "E0424"), "{:?}", checked.diagnostics);
    // E0601 offers the ring where it makes the plan fit, and only there: a device between
    // the two plans' totals (their workspace reserve, 5% of it, aside)
    let need = |p: &pipec_plan::Plan| p.devices.iter().map(|d| d.memory.total - d.memory.workspace).max().unwrap_or(0);
    let (gather_need, ring_need) = (need(&plan("", "1GB/s")), need(&plan(ring_comm, "1GB/s")));
    let mib = |bytes: u64| bytes as f64 / 1024.0 / 1024.0;
    assert!(mib(gather_need) - mib(ring_need) > 8.0, "{gather_need} vs {ring_need}");
    let at = |capacity_mib: u64| {
        let t = text("", "1GB/s").replace("memory: 80GiB", &format!("memory: {capacity_mib}MiB"));
        let result = compile_text(&t);
        let help: Vec<String> =
            result.diagnostics.iter().filter(|d| d.code == "E0601").filter_map(|d| d.help.clone()).collect();
        (!result.has_errors(), help.join(" "))
    };
    let between = ((mib(gather_need) + mib(ring_need)) / 2.0 / 0.95) as u64;
    let (fits, help) = at(between);
    assert!(!fits && help.contains("`cp_comm: ring`"), "{between} MiB: {help}");
    let ring_at = compile_text(&text(ring_comm, "1GB/s").replace("memory: 80GiB", &format!("memory: {between}MiB")));
    assert!(!ring_at.has_errors(), "the offered ring fits in {between} MiB: {:?}", ring_at.diagnostics);
    let below = (mib(ring_need) / 0.95) as u64 - 2;
    let (fits, help) = at(below);
    assert!(!fits && !help.contains("cp_comm"), "{below} MiB: never offered where it does not fit: {help}");
}

/// Sequence parallelism's collectives as each engine runs them, on a link slow enough that
/// they set the step: Megatron-LM gathers each column-split input again for the backward,
/// torchtitan keeps it (PyTorch's autograd) unless its op-level policy recomputes it, and
/// under Float8 with tensorwise scaling gathers FP8 both ways — each of the three is two of a
/// block's bf16 gathers.
#[test]
fn sequence_parallel_gathers_are_priced_as_each_engine_runs_them() {
    let step = |engine: &str, recompute: &str, fp8: bool| {
        let precision =
            if fp8 { "fp8\n  fp8: { recipe: tensorwise, activations: bf16, weight_copies: false }" } else { "bf16" };
        let text = format!(
            "name: sp\nengine: {engine}\nmodel:\n  input: [4096]\n  layers:\n    - embedding(1024, 1024)\n    - repeat 2: transformer_block(d=1024, heads=8, ff=4096, causal=true, norm=rmsnorm, mlp=swiglu, bias=false)\n    - rmsnorm\n    - linear(1024, 1024, bias=false)\n  loss: cross_entropy\n  attention: flash\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: h100-sxm\n  links:\n    intra_node: {{ bandwidth: 100MB/s, latency: 0us }}\nstrategy:\n  dp: 1\n  pp: 1\n  tp: 2\n  sequence_parallel: true\n  schedule: 1f1b\n  microbatches: 1\n  recompute: {recompute}\ntraining:\n  batch_size: 1\n  steps: 1\n  optimizer: {{ kind: adamw, lr: 0.001 }}\n  precision: {precision}\n"
        );
        compile_text(&text).into_compiled().expect("compiles").plan.simulation.step_time_s
    };
    let megatron = step("megatron", "false", false);
    let torchtitan = step("torchtitan", "false", false);
    let op_level = step("torchtitan", "{ ops: [alternate_matmul, attention] }", false);
    let float8 = step("torchtitan", "false", true);
    // a block's bf16 gather: 4096 × 1024 values of 2 bytes, half of them from the other rank
    let gather = 4096.0 * 1024.0 * 2.0 / 2.0 / 100e6;
    let two_blocks_two_gathers = 2.0 * 2.0 * gather;
    for (what, saved) in [
        ("Megatron-LM's gathers again", megatron - torchtitan),
        ("the op-level policy's gathers again", op_level - torchtitan),
        ("torchtitan's bf16 gathers against its FP8 ones", torchtitan - float8),
    ] {
        assert!(
            (saved / two_blocks_two_gathers - 1.0).abs() < 0.02,
            "{what}: {saved} s against {two_blocks_two_gathers} s"
        );
    }
}

/// Full recompute checkpoints each block alone, as the engines do: the layers after the
/// last block (the final norm, the output layer) keep their inputs beside the checkpoints.
/// Under sequence parallelism the final norm keeps its rank's share of the sequence, and the
/// output layer its share too where the engine gathers its input again in the backward
/// (Megatron-LM), the whole gathered input where it keeps it (torchtitan).
#[test]
fn full_recompute_keeps_the_layers_after_the_last_block_split_as_the_engine_splits_them() {
    let plan = |engine: &str, norm: bool, recompute: bool| {
        let norm = if norm { "    - rmsnorm\n" } else { "" };
        let text = format!(
            "name: tail\nengine: {engine}\nmodel:\n  input: [4096]\n  layers:\n    - embedding(1024, 1024)\n    - repeat 2: transformer_block(d=1024, heads=8, ff=4096, causal=true, norm=rmsnorm, mlp=swiglu, bias=false)\n{norm}    - linear(1024, 1024, bias=false)\n  loss: cross_entropy\n  attention: flash\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: h100-sxm\n  links: dgx-h100\nstrategy:\n  dp: 1\n  pp: 1\n  tp: 2\n  sequence_parallel: true\n  schedule: 1f1b\n  microbatches: 1\n  recompute: {recompute}\ntraining:\n  batch_size: 1\n  steps: 1\n  optimizer: {{ kind: adamw, lr: 0.001 }}\n  precision: bf16\n"
        );
        compile_text(&text).into_compiled().expect("compiles").plan
    };
    // one sample of 4096 positions × 1024 values in bf16, over the 2 ranks
    let share = 4096 * 1024 * 2 / 2;
    // (Megatron-LM and torchtitan train only models with a final norm; pipec's executor
    // runs sequence parallelism on whole activations, so its norm keeps the whole input)
    let with = plan("pipec", true, true).devices[0].memory.activations;
    let without = plan("pipec", false, true).devices[0].memory.activations;
    assert_eq!(with - without, 2 * share, "the final norm keeps its input under full recompute");
    let kept = |engine: &str, from_last: usize| {
        let p = plan(engine, true, false);
        p.layers[p.layers.len() - from_last].activation_bytes_per_sample
    };
    for engine in ["megatron", "torchtitan"] {
        assert_eq!(kept(engine, 2), share, "{engine}: the final norm keeps its share of the sequence");
    }
    assert_eq!(kept("megatron", 1), share, "Megatron-LM keeps its share and gathers again");
    assert_eq!(kept("torchtitan", 1), 2 * share, "torchtitan keeps the gathered input");
}
