//! Schedules checked against closed-form results, the verifier against every schedule and
//! against single-instruction mutations, and golden instruction streams.

use pipec_compiler::{compile, CompileOptions, Compiled};
use pipec_plan::{DeviceId, Instr, StageId};
use proptest::prelude::*;

/// A spec of `layers` equal linear layers on `devices` devices with free communication, so
/// the simulated bubble is the schedule's own. A free `flatten` reads the input, so that the
/// first linear layer computes its input gradient as every other one does (the model's first
/// layer does not) and the stages are equal.
fn spec(devices: usize, microbatches: usize, schedule: &str, layers: usize, stages: &str) -> String {
    format!(
        "model:
  input: [64]
  layers:
    - flatten
    - repeat {layers}: linear(64, 64)
  loss: mse
cluster:
  nodes: 1
  devices_per_node: {devices}
  device: {{ memory: 64GiB, throughput: 1GFLOP/s }}
  links:
    intra_node: {{ bandwidth: 1000000TB/s, latency: 0us }}
strategy:
  stages: {stages}
  schedule: {schedule}
  microbatches: {microbatches}
training:
  batch_size: {}
  steps: 1
  optimizer: {{ kind: sgd, lr: 0.1 }}
",
        microbatches * 4
    )
}

/// A small mixture-of-experts language model (4 blocks of 4 experts, top 2) on `devices`
/// devices, layout `stages`, expert-parallel degree `ep`.
/// A causal language model under context parallelism `cp` (its sequence of 8 in 2·cp chunks).
fn cp_spec(devices: usize, microbatches: usize, schedule: &str, stages: &str, cp: usize) -> String {
    moe_spec(devices, microbatches, schedule, stages, 1)
        .replace("transformer_block(16, 2, 32, experts=4, top_k=2)", "transformer_block(16, 2, 32, causal=true)")
        .replace("  ep: 1\n", &format!("  cp: {cp}\n"))
}

fn moe_spec(devices: usize, microbatches: usize, schedule: &str, stages: &str, ep: usize) -> String {
    format!(
        "model:
  input: [8]
  layers:
    - embedding(50, 16)
    - repeat 4: transformer_block(16, 2, 32, experts=4, top_k=2)
    - linear(16, 50, bias=false)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: {devices}
  device: {{ memory: 64GiB, throughput: 1GFLOP/s }}
  links:
    intra_node: {{ bandwidth: 100GB/s, latency: 1us }}
strategy:
  stages: {stages}
  schedule: {schedule}
  microbatches: {microbatches}
  ep: {ep}
training:
  batch_size: {}
  steps: 1
  optimizer: {{ kind: sgd, lr: 0.1 }}
",
        microbatches * 2
    )
}

/// `text` with its schedule as the paper gives it: `overlap: false`, so a later stage runs
/// each backward as one pass and sends its input gradient after it (by default it sends it
/// before its weight-gradient pass, `gradients_sent_first_*` below).
fn as_the_paper_gives_it(text: &str) -> String {
    assert!(text.contains("\ntraining:\n"));
    text.replace("\ntraining:\n", "\n  overlap: false\ntraining:\n")
}

/// `text` clipping the gradient's global norm (a `grad_norm` all-reduce before the updates).
fn clipped(text: &str) -> String {
    text.replace("  steps: 1\n", "  steps: 1\n  clip_grad_norm: 1.0\n")
}

/// With validation: a finite data set whose last quarter is held out, evaluated every step.
fn validated(text: &str) -> String {
    text.replace(
        "  steps: 1\n",
        "  steps: 1\n  data: { kind: synthetic, task: regression, samples: 1024 }\n  validation: { every: 1, split: 0.25 }\n",
    )
}

fn build(text: &str) -> Compiled {
    let checked = pipec_grammar::check_source(text);
    let spec = checked.spec.unwrap_or_else(|| panic!("spec has errors: {:?}\n{text}", checked.diagnostics));
    compile(&spec, &CompileOptions::default()).into_compiled().unwrap_or_else(|d| panic!("compile failed: {d:?}"))
}

/// Equal up to the (tiny, non-zero) transfer times of the nearly free links.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

/// The bubble fraction of a synchronous schedule on D uniform stages: (D − 1) / (D − 1 + V·N)
/// with V model chunks per device (1 for GPipe and 1F1B).
fn assert_closed_form_bubble(schedule: &str, d: usize, v: usize, n: usize) {
    let plan = build(&as_the_paper_gives_it(&spec(d, n, schedule, d * v * 2, "straight"))).plan;
    let expected = (d as f64 - 1.0) / (d as f64 - 1.0 + (v * n) as f64);
    assert_bubble(&plan, expected, format_args!("{schedule} D={d} V={v} N={n}"));
}

/// The plan's predicted bubble fraction is `expected` (to rounding).
fn assert_bubble(plan: &pipec_plan::Plan, expected: f64, what: std::fmt::Arguments<'_>) {
    let got = plan.simulation.bubble_fraction;
    assert!(close(got, expected), "{what}: bubble {got}, expected {expected}");
}

#[test]
fn gpipe_and_1f1b_bubble_is_closed_form() {
    for d in [2usize, 3, 4, 8] {
        for n in [1usize, 2, 4, 8, 16] {
            for sched in ["gpipe", "1f1b"] {
                assert_closed_form_bubble(sched, d, 1, n);
            }
        }
    }
}

/// GPipe and 1F1B on D uniform stages (forward F, backward B = B_in + B_w) when every later
/// stage sends its input gradient before its weight-gradient pass: the last microbatch's
/// gradient reaches the first stage (D − 1)·B_in after the last stage's input pass instead
/// of (D − 1)·B, so the step is N(F + B) + (D − 1)(F + B_in) and the bubble
/// (D − 1)(F + B_in) / (N(F + B) + (D − 1)(F + B_in)): for linear layers (B = 2F, B_in = F)
/// 2(D − 1) / (3N + 2(D − 1)), against the paper's 3(D − 1) / (3N + 3(D − 1)).
#[test]
fn gradients_sent_first_give_the_closed_form_bubble() {
    for d in [2usize, 3, 4, 8] {
        for n in [1usize, 2, 4, 8, 16] {
            for sched in ["gpipe", "1f1b"] {
                let plan = build(&spec(d, n, sched, d * 2, "straight")).plan;
                let (f, b) = (plan.stages[0].forward_s, plan.stages[0].backward_s);
                assert!(close(b, 2.0 * f), "linear layers: a backward is two forwards");
                let b_in = b / 2.0;
                let idle = (d as f64 - 1.0) * (f + b_in);
                let step = n as f64 * (f + b) + idle;
                assert!(close(plan.simulation.step_time_s, step), "{sched} D={d} N={n}: step");
                let expected = idle / step;
                assert_bubble(&plan, expected, format_args!("{sched} D={d} N={n}, gradients sent first"));
                let paper = build(&as_the_paper_gives_it(&spec(d, n, sched, d * 2, "straight"))).plan;
                assert!(close(paper.simulation.step_time_s, n as f64 * (f + b) + (d as f64 - 1.0) * (f + b)));
            }
        }
    }
}

/// Sending gradients first only moves sends earlier: on every synchronous schedule, with
/// uneven stages and links that cost something, no step is longer than the paper's, every
/// device runs the same passes in the same order (each later stage's backward as its
/// input then weight pass), and the first stage's backwards stay whole.
#[test]
fn gradients_sent_first_never_lengthen_a_step() {
    let schedules = ["gpipe", "1f1b", "{ kind: interleaved, virtual_stages: 2 }", "chimera", "zb-h1"];
    for d in [2usize, 4] {
        for n in [d, 2 * d, 3 * d] {
            for sched in schedules {
                for layers in [2 * d + 1, 4 * d - 1] {
                    let text = spec(d, n, sched, layers, "straight").replace(
                        "intra_node: { bandwidth: 1000000TB/s, latency: 0us }",
                        "intra_node: { bandwidth: 2GB/s, latency: 20us }",
                    );
                    let (Some(ours), Some(paper)) = (compile_ok(&text), compile_ok(&as_the_paper_gives_it(&text)))
                    else {
                        continue;
                    };
                    let what = format!("{sched} D={d} N={n} layers={layers}");
                    assert!(
                        ours.simulation.step_time_s <= paper.simulation.step_time_s * (1.0 + 1e-9),
                        "{what}: {} against the paper's {}",
                        ours.simulation.step_time_s,
                        paper.simulation.step_time_s
                    );
                    for (dev, stream) in &ours.streams {
                        let expanded: Vec<String> = pipec_compiler::lower::compute_order(&paper.streams[dev])
                            .iter()
                            .flat_map(|t| {
                                let s = t.to_string();
                                match s.split_once('B') {
                                    Some((stage, mb)) if stage != "0" => {
                                        vec![format!("{stage}I{mb}"), format!("{stage}W{mb}")]
                                    }
                                    _ => vec![s],
                                }
                            })
                            .collect();
                        let got: Vec<String> =
                            pipec_compiler::lower::compute_order(stream).iter().map(ToString::to_string).collect();
                        assert_eq!(got, expanded, "{what}: {dev}");
                    }
                }
            }
        }
    }
}

/// The plan of `text`, or None where the strategy does not apply (an uneven split Chimera
/// refuses).
fn compile_ok(text: &str) -> Option<pipec_plan::Plan> {
    let spec = pipec_grammar::check_source(text).spec?;
    compile(&spec, &CompileOptions::default()).into_compiled().ok().map(|c| c.plan)
}

#[test]
fn interleaved_bubble_is_closed_form() {
    for d in [2usize, 4] {
        for v in [2usize, 3] {
            for n in [d, 2 * d, 4 * d] {
                assert_closed_form_bubble(&format!("{{ kind: interleaved, virtual_stages: {v} }}"), d, v, n);
            }
        }
    }
}

#[test]
fn in_flight_microbatches_are_closed_form() {
    for d in [2usize, 4] {
        for n in [1usize, 3, 8] {
            let onefb = build(&spec(d, n, "1f1b", d, "straight")).plan;
            let gpipe = build(&spec(d, n, "gpipe", d, "straight")).plan;
            for s in 0..d {
                let stage = pipec_plan::StageId(s as u32);
                assert_eq!(
                    onefb.devices[s].peak_in_flight[&stage] as usize,
                    n.min(d - s),
                    "1F1B D={d} N={n} stage {s}"
                );
                assert_eq!(gpipe.devices[s].peak_in_flight[&stage] as usize, n, "GPipe D={d} N={n} stage {s}");
            }
        }
    }
}

#[test]
fn zero_bubble_h1_beats_1f1b_with_the_same_memory() {
    // ZB-H1 (Qi et al. 2024): with F = B_input = B_weight the bubble shrinks to about a
    // third of 1F1B's, at 1F1B's peak activation memory.
    for d in [2usize, 4, 8] {
        let n = 3 * d;
        let zb = build(&spec(d, n, "zb-h1", d, "straight")).plan;
        let ob = build(&as_the_paper_gives_it(&spec(d, n, "1f1b", d, "straight"))).plan;
        let early = build(&spec(d, n, "1f1b", d, "straight")).plan;
        let zb_idle = zb.simulation.bubble_fraction * zb.simulation.step_time_s;
        let ob_idle = ob.simulation.bubble_fraction * ob.simulation.step_time_s;
        let early_idle = early.simulation.bubble_fraction * early.simulation.step_time_s;
        // In units of one pass (F = I = W = t): 1F1B idles 3(D−1)t per device, 2(D−1)t when
        // later stages send their gradients first, ZB-H1 (D−1)t.
        let t = zb.stages[0].forward_s;
        let per_device_zb = zb_idle * d as f64;
        let per_device_ob = ob_idle * d as f64;
        assert!(
            (per_device_ob / d as f64 - 3.0 * (d as f64 - 1.0) * t).abs() < 1e-6 * per_device_ob.max(1e-12) + 1e-9,
            "D={d}: 1f1b idle {per_device_ob} vs closed form"
        );
        assert!(
            (early_idle - 2.0 * (d as f64 - 1.0) * t).abs() < 1e-6 * per_device_ob.max(1e-12) + 1e-9,
            "D={d}: 1f1b sending gradients first idles {early_idle} vs 2(D-1)t"
        );
        assert!(
            (per_device_zb / d as f64 - (d as f64 - 1.0) * t).abs() < 1e-6 * per_device_ob.max(1e-12) + 1e-9,
            "D={d}: zb-h1 idle {per_device_zb} per device vs (D-1)t = {}",
            (d as f64 - 1.0) * t
        );
        // Peak activation memory over the pipeline equals 1F1B's (D microbatches).
        let peak =
            |p: &pipec_plan::Plan| p.devices.iter().flat_map(|d| d.peak_in_flight.values().copied()).max().unwrap_or(0);
        assert_eq!(peak(&zb), peak(&ob), "D={d}");
    }
}

#[test]
fn zero_bubble_v_idles_less_as_microbatches_grow_at_1f1bs_peak_memory() {
    // ZB-V (Qi et al. 2024): two chunks per device in a V, with F = B_input = B_weight
    // (linear stages) its bubble tends to zero as microbatches grow, every device holding at
    // most 2D chunk-microbatches' activations — 1F1B's peak, D whole-stage microbatches on
    // its first device. A bound of 1F1B's per-device count (2D − d on device d) starves the
    // later devices: a fifth of the step idle, not shrinking with N.
    for d in [2usize, 4] {
        let mut last = f64::INFINITY;
        for n in [2 * d, 4 * d, 8 * d, 16 * d] {
            let zbv = build(&spec(d, n, "{ kind: zbv, virtual_stages: 2 }", 2 * d, "straight")).plan;
            let onefb = build(&spec(d, n, "1f1b", 2 * d, "straight")).plan;
            let (b, b1) = (zbv.simulation.bubble_fraction, onefb.simulation.bubble_fraction);
            assert!(b < last, "D={d} N={n}: ZB-V's bubble {b} does not shrink (was {last})");
            assert!(b < b1, "D={d} N={n}: ZB-V's bubble {b} not below 1F1B's {b1}");
            last = b;
            // the most chunk-microbatches a device keeps at once, from its stream
            let most = zbv
                .streams
                .values()
                .map(|s| {
                    s.iter()
                        .scan(0i64, |now, i| {
                            *now += match i {
                                pipec_plan::Instr::Forward { .. } => 1,
                                pipec_plan::Instr::Free { .. } => -1,
                                _ => 0,
                            };
                            Some(*now)
                        })
                        .max()
                        .unwrap_or(0)
                })
                .max()
                .unwrap_or(0);
            assert!(most <= 2 * d as i64, "D={d} N={n}: a device keeps {most} chunk-microbatches, above 2D");
        }
        assert!(last < 0.05, "D={d}: ZB-V idles {last} of the step at N = 16D");
    }
}

/// Stages whose backward takes as long as their forward (element-wise layers), the
/// assumption of Chimera's bubble formula.
fn equal_pass_spec(devices: usize, microbatches: usize, schedule: &str) -> String {
    spec(devices, microbatches, schedule, devices, "straight")
        .replace(&format!("- repeat {devices}: linear(64, 64)"), &format!("- repeat {devices}: relu"))
}

#[test]
fn chimera_bubble_follows_the_paper() {
    // Li & Hoefler 2021: with equal forward and backward times, Chimera's bubble ratio is
    // (D−2)/(2N+D−2) for N a multiple of D (basic units of D microbatches, concatenated).
    for d in [2usize, 4, 6, 8, 10, 12] {
        for k in 1..=4 {
            let n = k * d;
            let plan = build(&as_the_paper_gives_it(&equal_pass_spec(d, n, "chimera"))).plan;
            let paper = (d as f64 - 2.0) / (2.0 * n as f64 + d as f64 - 2.0);
            assert_bubble(&plan, paper, format_args!("D={d} N={n}"));
        }
    }
}

#[test]
fn chimera_with_data_parallelism_keeps_the_papers_bubble_per_pipeline_pair() {
    // R pipeline pairs side by side, each with N/R microbatches: (D−2)/(2N/R+D−2).
    for (d, r, n) in [(4usize, 2usize, 8usize), (4, 2, 16), (2, 3, 12), (6, 2, 24)] {
        let layout = format!("\"{}\"", vec![r.to_string(); d].join("-"));
        let text = spec(d * r, n, "chimera", d, &layout)
            .replace(&format!("- repeat {d}: linear(64, 64)"), &format!("- repeat {d}: relu"));
        let plan = build(&as_the_paper_gives_it(&text)).plan;
        let per_pair = (n / r) as f64;
        let paper = (d as f64 - 2.0) / (2.0 * per_pair + d as f64 - 2.0);
        assert_bubble(&plan, paper, format_args!("D={d} R={r} N={n}"));
        // every stage has 2R copies, all in one gradient group
        for s in &plan.stages {
            assert_eq!(s.replicas.len(), 2 * r);
            let mut devs = s.replicas.clone();
            devs.sort();
            devs.dedup();
            assert_eq!(devs.len(), 2 * r, "stage {:?}: copies on distinct devices", s.id);
        }
    }
}

#[test]
fn chimera_with_twice_as_long_backwards_beats_1f1b_within_bounded_memory() {
    // Linear layers: a backward takes two forwards. Concatenating units packed against
    // that length keeps Chimera ahead of 1F1B for every N (the paper's direct
    // concatenation with equal-length slots falls behind 1F1B from N = 3D on), while a
    // device holds at most D + D/2 microbatches' activations at once (1F1B: D).
    for d in [4usize, 6, 8, 12] {
        for k in 1..=4 {
            let n = k * d;
            let ch = build(&as_the_paper_gives_it(&spec(d, n, "chimera", d, "straight"))).plan;
            let ob = build(&as_the_paper_gives_it(&spec(d, n, "1f1b", d, "straight"))).plan;
            assert!(
                ch.simulation.bubble_fraction < ob.simulation.bubble_fraction,
                "D={d} N={n}: chimera {} vs 1f1b {}",
                ch.simulation.bubble_fraction,
                ob.simulation.bubble_fraction
            );
            assert!(ch.simulation.step_time_s < ob.simulation.step_time_s, "D={d} N={n}");
            for (dev, stream) in &ch.streams {
                let mut live = 0i64;
                let mut peak = 0i64;
                for i in stream {
                    match i {
                        pipec_plan::instr::Instr::Forward { .. } => live += 1,
                        pipec_plan::instr::Instr::Backward { .. } => live -= 1,
                        _ => {}
                    }
                    peak = peak.max(live);
                }
                assert!(peak as usize <= d + d / 2, "D={d} N={n}: device {dev} holds {peak} microbatches");
            }
        }
    }
}

#[test]
fn chimera_has_fewer_bubbles_than_1f1b() {
    // Chimera (Li & Hoefler 2021): two opposite pipelines fill each other's bubbles.
    for d in [2usize, 4, 6] {
        let n = d;
        let ch = build(&spec(d, n, "chimera", d, "straight")).plan;
        let ob = build(&spec(d, n, "1f1b", d, "straight")).plan;
        assert!(
            ch.simulation.bubble_fraction < ob.simulation.bubble_fraction,
            "D={d}: chimera {} vs 1f1b {}",
            ch.simulation.bubble_fraction,
            ob.simulation.bubble_fraction
        );
    }
}

/// Verifies `streams` as the plan's (a flush-free plan's body: unrolled with its prologue
/// and epilogue over 1–3 steps).
fn verify_plan(c: &Compiled, streams: &std::collections::BTreeMap<DeviceId, Vec<Instr>>) -> Vec<String> {
    if c.plan.flush_free.is_some() {
        let mut plan = c.plan.clone();
        plan.streams = streams.clone();
        return pipec_compiler::verification::verify_plan(&plan);
    }
    pipec_compiler::verification::verify_streams(&c.plan, streams)
}

/// One small plan of every schedule.
fn every_schedule() -> Vec<(&'static str, Compiled)> {
    vec![
        ("gpipe", build(&spec(3, 4, "gpipe", 6, "straight"))),
        ("1f1b", build(&spec(3, 4, "1f1b", 6, "straight"))),
        ("interleaved", build(&spec(2, 4, "{ kind: interleaved, virtual_stages: 2 }", 8, "straight"))),
        ("pipedream", build(&spec(4, 4, "pipedream", 6, "\"2-1-1\""))),
        ("pipedream-vertical-sync", build(&spec(3, 6, "{ kind: pipedream, vertical_sync: true }", 6, "straight"))),
        ("2bw", build(&spec(3, 6, "2bw", 6, "straight"))),
        ("chimera", build(&spec(4, 4, "chimera", 8, "straight"))),
        ("chimera-two-units", build(&spec(4, 8, "chimera", 4, "straight"))),
        ("chimera-dp2", build(&spec(4, 8, "chimera", 2, "\"2-2\""))),
        ("zb-h1", build(&spec(3, 4, "zb-h1", 6, "straight"))),
        ("zbv", build(&spec(2, 4, "zbv", 8, "straight"))),
        ("dp-only", build(&spec(2, 4, "dp-only", 4, "\"2\""))),
        ("dp-only-asp", build(&spec(3, 12, "{ kind: dp-only, sync: asp, staleness: 1 }", 4, "\"3\""))),
        ("hybrid-1f1b", build(&spec(4, 4, "1f1b", 4, "\"2-2\""))),
        ("tensor-parallel-1f1b", build(&spec(4, 4, "1f1b", 4, "\"1-1\"\n  tp: 2"))),
        ("zero-1-hybrid-1f1b", build(&spec(4, 4, "1f1b", 4, "\"2-2\"\n  zero: 1"))),
        ("zero-2-interleaved", build(&spec(4, 4, "{ kind: interleaved, virtual_stages: 2 }", 8, "\"2-2\"\n  zero: 2"))),
        ("zero-3-hybrid-1f1b", build(&spec(4, 4, "1f1b", 4, "\"2-2\"\n  zero: 3"))),
        ("zero-3-dp-only", build(&spec(2, 4, "dp-only", 4, "\"2\"\n  zero: 3"))),
        ("zero-2-tensor-parallel", build(&spec(8, 4, "zb-h1", 4, "\"2-2\"\n  tp: 2\n  zero: 2"))),
        ("clipped-zero-1-tensor-parallel", build(&clipped(&spec(8, 4, "1f1b", 4, "\"2-2\"\n  tp: 2\n  zero: 1")))),
        (
            "clipped-interleaved",
            build(&clipped(&spec(2, 4, "{ kind: interleaved, virtual_stages: 2 }", 8, "straight"))),
        ),
        ("dualpipev", build(&spec(2, 4, "dualpipev", 8, "straight"))),
        ("dualpipe", build(&spec(2, 4, "dualpipe", 4, "straight"))),
        ("dualpipe-4-ranks", build(&spec(4, 10, "dualpipe", 8, "straight"))),
        ("dualpipe-dp2", build(&spec(4, 8, "dualpipe", 4, "\"2-2\""))),
        ("dualpipev-3-ranks", build(&spec(3, 7, "dualpipev", 12, "straight"))),
        ("dualpipev-dp2", build(&spec(4, 8, "dualpipev", 8, "\"2-2\""))),
        ("expert-parallel-dualpipev", build(&moe_spec(4, 8, "dualpipev", "\"2-2\"", 2))),
        ("expert-parallel-dualpipe", build(&moe_spec(4, 8, "dualpipe", "\"2-2\"", 2))),
        ("expert-parallel-dp-only", build(&moe_spec(4, 8, "dp-only", "\"4\"", 4))),
        ("expert-parallel-1f1b", build(&moe_spec(4, 4, "1f1b", "\"2-2\"", 2))),
        (
            "expert-parallel-interleaved-ep-overlap",
            build(&moe_spec(4, 8, "{ kind: interleaved, virtual_stages: 2 }", "\"2-2\"\n  ep_overlap: true", 2)),
        ),
        ("expert-parallel-dp-only-ep-overlap", build(&moe_spec(4, 8, "dp-only", "\"4\"\n  ep_overlap: true", 4))),
        ("expert-parallel-zbv", build(&moe_spec(4, 4, "zbv", "\"2-2\"", 2))),
        ("expert-parallel-tensor-parallel", build(&moe_spec(8, 4, "1f1b", "\"2-2\"\n  tp: 2", 2))),
        ("context-parallel-1f1b", build(&cp_spec(4, 2, "1f1b", "\"1-1\"", 2))),
        ("context-parallel-dp-only", build(&cp_spec(4, 4, "dp-only", "\"2\"", 2))),
        (
            "context-parallel-interleaved",
            build(&cp_spec(4, 2, "{ kind: interleaved, virtual_stages: 2 }", "\"1-1\"", 2)),
        ),
        ("context-parallel-zero-1", build(&cp_spec(4, 2, "gpipe", "\"1-1\"\n  zero: 1", 2))),
    ]
}

/// Expert parallelism: the members of a group exchange tokens inside every pass of their
/// expert stages, so any reordering of those passes on one member — not only the swaps of
/// neighbours that touch a common buffer — is caught, as are a dropped or repeated pass.
#[test]
fn every_reordering_of_an_expert_parallel_members_passes_is_caught() {
    for (name, c) in every_schedule()
        .into_iter()
        .filter(|(n, _)| n.starts_with("expert-parallel") || n.starts_with("context-parallel"))
    {
        let streams = &c.plan.streams;
        assert!(verify_plan(&c, streams).is_empty(), "{name}");
        let cp = c.plan.training.context_parallel > 1;
        let expert_stage = |s: pipec_plan::StageId| cp || c.plan.stage(s).is_some_and(|st| st.expert_parallel > 1);
        let mut tried = 0;
        for (dev, stream) in streams {
            let passes: Vec<usize> = (0..stream.len())
                .filter(|&i| {
                    matches!(
                        stream[i],
                        Instr::Forward { .. }
                            | Instr::Backward { .. }
                            | Instr::BackwardInput { .. }
                            | Instr::Recompute { .. }
                    ) && expert_stage(stream[i].stage())
                })
                .collect();
            for (a, &i) in passes.iter().enumerate() {
                for &j in &passes[a + 1..] {
                    if stream[i].phase() == stream[j].phase() && stream[i].stage() == stream[j].stage() {
                        // two passes of one kind and stage: swapping them swaps microbatches
                        let mut m = streams.clone();
                        m.get_mut(dev).expect("device").swap(i, j);
                        let found = verify_plan(&c, &m);
                        assert!(
                            !found.is_empty(),
                            "{name}: swapping {dev}[{i}] `{}` and [{j}] `{}` was not caught",
                            stream[i],
                            stream[j]
                        );
                        tried += 1;
                    }
                }
            }
        }
        assert!(tried > 0, "{name}");
    }
}

/// The context-parallel checks: a member that runs its chunks of two microbatches in the
/// other order, or a chunk routed to the wrong member of its group, is named.
#[test]
fn a_context_parallel_member_out_of_step_or_on_the_wrong_chunk_is_named() {
    let c = build(&cp_spec(2, 2, "gpipe", "\"1\"", 2));
    assert_eq!(c.plan.training.context_parallel, 2);
    assert_eq!(c.plan.training.microbatches, 4, "2 microbatches of 2 chunks");
    assert!(verify_plan(&c, &c.plan.streams).is_empty());
    let mut streams = c.plan.streams.clone();
    let s = streams.get_mut(&DeviceId(1)).expect("d1");
    let forwards: Vec<usize> = (0..s.len()).filter(|&i| matches!(s[i], Instr::Forward { .. })).collect();
    assert_eq!(forwards.len(), 2, "chunk 1 of each of the two microbatches");
    s.swap(forwards[0], forwards[1]);
    let found = verify_plan(&c, &streams);
    assert!(found.iter().any(|v| v.contains("context-parallel exchange 0 of d1")), "{found:#?}");
    // chunk 0 of microbatch 0 routed to member 1 (and chunk 1 to member 0)
    let mut plan = c.plan.clone();
    plan.stages[0].route.swap(0, 1);
    let found = pipec_compiler::verification::verify_streams(&plan, &plan.streams);
    assert!(found.iter().any(|v| v.contains("is not at position 0 of a context-parallel group of 2")), "{found:#?}");
}

/// An expert group drawn from two context-parallel groups: its members run chunks of
/// different microbatches, matched by their place in each member's run. A context-parallel
/// group that runs its two microbatches in the other order — in step with itself, out of
/// step with the expert group's other members — is named by the expert check.
#[test]
fn an_expert_group_across_context_parallel_groups_is_checked_in_step() {
    let spec = moe_spec(4, 4, "gpipe", "\"2\"", 4).replace("  ep: 4\n", "  ep: 4\n  cp: 2\n");
    let c = build(&spec);
    assert_eq!((c.plan.training.context_parallel, c.plan.stages[0].expert_parallel), (2, 4));
    assert!(verify_plan(&c, &c.plan.streams).is_empty());
    let mut streams = c.plan.streams.clone();
    for d in [2, 3] {
        let s = streams.get_mut(&DeviceId(d)).expect("a member of the second context-parallel group");
        let forwards: Vec<usize> = (0..s.len()).filter(|&i| matches!(s[i], Instr::Forward { .. })).collect();
        assert_eq!(forwards.len(), 2, "its chunks of the replica's two microbatches");
        s.swap(forwards[0], forwards[1]);
    }
    let found = verify_plan(&c, &streams);
    assert!(found.iter().any(|v| v.contains("expert-parallel all-to-all 0 of d2")), "{found:#?}");
    assert!(!found.iter().any(|v| v.contains("context-parallel exchange")), "{found:#?}");
}

/// The expert-parallel check itself: a member that runs its two forwards of an expert
/// stage in the other order — data flow and messages still sound — is named by it.
#[test]
fn a_member_out_of_step_with_its_expert_group_is_named() {
    let c = build(&moe_spec(2, 4, "gpipe", "\"2\"", 2));
    let mut streams = c.plan.streams.clone();
    let s = streams.get_mut(&DeviceId(1)).expect("d1");
    let forwards: Vec<usize> = (0..s.len()).filter(|&i| matches!(s[i], Instr::Forward { .. })).collect();
    assert_eq!(forwards.len(), 2, "two microbatches on each of the two replicas");
    s.swap(forwards[0], forwards[1]);
    let found = verify_plan(&c, &streams);
    assert!(found.iter().any(|v| v.contains("expert-parallel all-to-all 0 of d1")), "{found:#?}");
}

/// Expert parallelism's all-to-alls are the plan's own instructions: after every pass of an
/// expert stage, at each of its expert layers, the two exchanges of the pass (a forward's
/// dispatch and combine first layer to last, a backward's gradients last to first), over
/// the device's expert group; a member that posts one of another size, over another group
/// or out of its pass is named, and an all-to-all over a group that is not an expert group
/// of its stage is refused with the plan's structure.
#[test]
fn all_to_alls_are_checked_one_by_one() {
    let c = build(&moe_spec(4, 4, "1f1b", "\"2-2\"", 2));
    let streams = &c.plan.streams;
    for (d, stream) in streams {
        for (i, ins) in stream.iter().enumerate() {
            let layers = &c.plan.stages[ins.stage().0 as usize].all_to_alls;
            let posted = match ins {
                Instr::Forward { .. } => {
                    layers.iter().flat_map(|l| [(l.layer, "dispatch"), (l.layer, "combine")]).collect()
                }
                Instr::Backward { .. } => {
                    layers.iter().rev().flat_map(|l| [(l.layer, "combine_grad"), (l.layer, "dispatch_grad")]).collect()
                }
                _ => Vec::new(),
            };
            assert_eq!(posted.len(), if posted.is_empty() { 0 } else { 4 }, "two expert layers per stage");
            for (k, (layer, exchange)) in posted.into_iter().enumerate() {
                match &stream[i + 1 + k] {
                    Instr::AllToAll { stage, mb, layer: l, exchange: e, bytes, group } => {
                        assert_eq!((*stage, Some(*mb), *l, e.name()), (ins.stage(), ins.microbatch(), layer, exchange));
                        assert!(*bytes > 0);
                        let g = c.plan.groups.iter().find(|x| x.id == *group).expect("the group");
                        assert!(g.experts && g.devices.contains(d) && g.devices.len() == 2, "{g:?}");
                    }
                    other => panic!("{d}: `{ins}` is followed by `{other}`"),
                }
            }
        }
    }
    let at = |d: u32, k: usize| {
        let s = &streams[&DeviceId(d)];
        (0..s.len()).filter(|&i| matches!(s[i], Instr::AllToAll { .. })).nth(k).expect("an all-to-all")
    };
    let edit = |d: u32, k: usize, f: &dyn Fn(&mut Instr)| {
        let mut m = streams.clone();
        let i = at(d, k);
        f(&mut m.get_mut(&DeviceId(d)).expect("device")[i]);
        verify_plan(&c, &m)
    };
    // another size on one member
    let found = edit(1, 0, &|i| {
        if let Instr::AllToAll { bytes, .. } = i {
            *bytes += 4;
        }
    });
    assert!(
        found.iter().any(|v| v.contains("(its all-to-all 0) next, not `all_to_all") && v.contains("2052B")),
        "{found:#?}"
    );
    // the other stage's expert group
    let other = c.plan.groups.iter().find(|g| g.experts && g.stage == StageId(1)).expect("stage 1's expert group").id;
    let found = edit(0, 0, &|i| {
        if let Instr::AllToAll { group, .. } = i {
            *group = other;
        }
    });
    assert!(found.iter().any(|v| v.contains("(its all-to-all 0) next, not `all_to_all")), "{found:#?}");
    // out of its pass: the first all-to-all moved behind the forward's send
    let mut m = streams.clone();
    let s = m.get_mut(&DeviceId(0)).expect("d0");
    let first = at(0, 0);
    let moved = s.remove(first);
    let send = (first..s.len()).find(|&i| matches!(s[i], Instr::SendActivation { .. })).expect("a send");
    s.insert(send + 1, moved);
    let found = verify_plan(&c, &m);
    assert!(found.iter().any(|v| v.contains("is not posted by the pass before it")), "{found:#?}");
    // over the stage's replica group: the plan's structure refuses it
    let mut plan = c.plan.clone();
    let replicas = plan.stages[0].group.expect("a replica group");
    if let Instr::AllToAll { group, .. } = &mut plan.streams.get_mut(&DeviceId(0)).expect("d0")[first] {
        *group = replicas;
    }
    let found = pipec_compiler::verification::verify_plan(&plan);
    assert!(found.iter().any(|v| v.contains("not an expert group of that stage")), "{found:#?}");
}

#[test]
fn golden_streams_for_every_schedule() {
    for (name, c) in every_schedule() {
        assert!(verify_plan(&c, &c.plan.streams).is_empty());
        insta::assert_snapshot!(format!("streams__{name}"), c.plan.streams_text());
    }
}

/// DualPipeV's bubble on uniform stages, against the published formula (DeepSeek's DualPipe
/// README: (PP/2 − 1)(F&B + B − 3W) per device for PP stages). With R = PP/2 devices, F a
/// chunk's forward, B its whole backward (2F here: two products per layer), W its weight
/// half (F) and F&B — a forward and a backward overlapped — at F + B (no all-to-all to hide
/// here), that is (R − 1)(F + 2B − 3W) = 2(R − 1)F: a pair starts once both its inputs are
/// in, as the reference runs it (the pair's gradient is received before its forward). The
/// step is each device's 2N(F + B) of compute plus that, for every microbatch count from
/// the 2R the schedule needs.
#[test]
fn dualpipev_bubbles_match_the_published_formula() {
    for ranks in 2..=4usize {
        for n in [2 * ranks, 2 * ranks + 1, 3 * ranks, 4 * ranks + 2] {
            let plan = build(&as_the_paper_gives_it(&spec(ranks, n, "dualpipev", 2 * ranks * 2, "straight"))).plan;
            let f = plan.stages[0].forward_s;
            let b = plan.stages[0].backward_s;
            assert!(close(b, 2.0 * f), "linear layers: B = 2F ({b} vs {f})");
            let (r, w) = (ranks as f64, b / 2.0);
            let compute = 2.0 * n as f64 * (f + b);
            let published = (r - 1.0) * ((f + b) + b - 3.0 * w);
            let got = plan.simulation.step_time_s - compute;
            assert!(
                (got - published).abs() < 1e-6 * compute,
                "R={ranks} N={n}: bubble {got}, (R−1)(F&B+B−3W) {published}"
            );
        }
    }
}

/// DualPipe's bubble on uniform stages: D devices, two pipelines of D stages in opposite
/// directions, N microbatches (N/2 each way): the published (D/2 − 1)(F&B + B − 3W) with
/// F&B = F + B, i.e. (D/2 − 1)(F + 2B − 3W) = 2(D/2 − 1)F here (B = 2F, W = F), as
/// DualPipeV's with R = D/2 (`dualpipev_bubbles_match_the_published_formula` above). Each
/// device computes both directions' N/2 microbatches of its two stages: N(F + B).
#[test]
fn dualpipe_bubbles_match_the_published_formula() {
    for ranks in [2usize, 4, 6] {
        for n in [2 * ranks, 2 * ranks + 2, 4 * ranks] {
            let plan = build(&as_the_paper_gives_it(&spec(ranks, n, "dualpipe", 2 * ranks, "straight"))).plan;
            let f = plan.stages[0].forward_s;
            let b = plan.stages[0].backward_s;
            assert!(close(b, 2.0 * f), "linear layers: B = 2F ({b} vs {f})");
            let (h, w) = (ranks as f64 / 2.0, b / 2.0);
            let compute = n as f64 * (f + b);
            let published = (h - 1.0) * ((f + b) + b - 3.0 * w);
            let got = plan.simulation.step_time_s - compute;
            assert!(
                (got - published).abs() < 1e-6 * compute,
                "D={ranks} N={n}: bubble {got}, (D/2−1)(F&B+B−3W) {published}"
            );
        }
    }
}

/// DualPipe's overlap of one chunk's all-to-alls with the other's computation: on an
/// expert-parallel DualPipeV or DualPipe plan, each pair — a forward right before a whole
/// backward of the device's other stage (`overlapped_pair`), with the all-to-alls each
/// posts — takes the longer of the two passes' computations and their all-to-alls, and at
/// least the forward with its own (the forward its computation, the backward the rest, its
/// all-to-alls nothing); every other pass its computation, then its all-to-alls their
/// whole time. The devices' forward, backward and all-to-all seconds are those, from the
/// plan's stage figures; the plan reports what the pairs hid, and they hide something.
///
/// Megatron-LM's combined 1F1B (`ep_overlap`) on one stage per device and on an interleaved
/// pipeline, each forward after the warm-up's one more with the backward of an earlier
/// microbatch after it (`Pairing::OtherTask`): its pairs overlap layer by layer, phase by
/// phase (`PlanCost::overlapped_exchanges`, tested with the layers' parts in
/// `bound.rs`), so each takes at least the longer of the two sums and at most the
/// two passes one after the other; what the plan reports hidden is at most what a whole
/// overlap would hide, and more than nothing.
#[test]
fn dualpipe_pairs_hide_their_all_to_alls_under_each_others_computation() {
    use pipec_plan::schedule::Pairing;
    let overlapped = |text: String| text.replace("  ep: 2\n", "  ep: 2\n  ep_overlap: true\n");
    let cases = [
        ("dualpipev", moe_spec(4, 8, "dualpipev", "\"2-2\"", 2), Pairing::OtherStage),
        ("dualpipe", moe_spec(4, 8, "dualpipe", "\"2-2\"", 2), Pairing::OtherStage),
        ("dp-only, ep_overlap", overlapped(moe_spec(2, 8, "dp-only", "\"2\"", 2)), Pairing::OtherTask),
        ("1f1b, ep_overlap", overlapped(moe_spec(2, 8, "1f1b", "\"2\"", 2)), Pairing::OtherTask),
        (
            "interleaved, ep_overlap",
            overlapped(moe_spec(4, 8, "{ kind: interleaved, virtual_stages: 2 }", "\"2-2\"", 2)),
            Pairing::OtherTask,
        ),
    ];
    for (schedule, text, pairing) in cases {
        let c = build(&text);
        assert_eq!(c.plan.schedule.pairing(), Some(pairing), "{schedule}");
        let stages = &c.plan.stages;
        // a pass's computation and its all-to-alls
        let pass = |i: &Instr| {
            let s = &stages[i.stage().0 as usize];
            match i {
                Instr::Forward { .. } => (s.forward_s, s.all_to_all_s[0]),
                _ => (s.backward_s, s.all_to_all_s[1]),
            }
        };
        let mut saved = 0.0;
        for d in &c.plan.simulation.devices {
            let stream = &c.plan.streams[&d.id];
            let (mut forward, mut backward, mut exchanged, mut hidden) = (0.0, 0.0, 0.0, 0.0);
            let mut rest: Option<(usize, f64)> = None;
            for (i, ins) in stream.iter().enumerate() {
                match ins {
                    Instr::Forward { .. } => {
                        let (f, af) = pass(ins);
                        forward += f;
                        match pipec_plan::schedule::overlapped_pair(stream, i, pairing) {
                            Some(j) => {
                                let (b, ab) = pass(&stream[j]);
                                // DualPipe's whole overlap; the combined 1F1B's at most that
                                let pair = (f + b).max(af + ab).max(f + af);
                                hidden += f + af + b + ab - pair;
                                rest = Some((j, pair - f));
                            }
                            None => exchanged += af,
                        }
                    }
                    // (zero-bubble's split: its input half posts the backward's all-to-alls)
                    Instr::BackwardInput { .. } => exchanged += pass(ins).1,
                    Instr::Backward { .. } => match rest {
                        Some((j, r)) if j == i => backward += r,
                        _ => {
                            let (b, ab) = pass(ins);
                            backward += b;
                            exchanged += ab;
                        }
                    },
                    _ => {}
                }
            }
            // each pair starts with both its inputs in: the backward's gradient is received
            // before the forward (the lowering's side of the one pair rule)
            for (i, ins) in stream.iter().enumerate() {
                let Some(j) = pipec_plan::schedule::overlapped_pair(stream, i, pairing) else { continue };
                let (Instr::Backward { stage, mb }, last) = (&stream[j], stages.len() - 1) else { continue };
                if stage.0 as usize != last {
                    let received = stream[..i]
                        .iter()
                        .any(|r| matches!(r, Instr::RecvGradient { stage: s, mb: m, .. } if s == stage && m == mb));
                    assert!(received, "{schedule} {}: `{}` starts before `{}`'s gradient is in", d.id, ins, stream[j]);
                }
            }
            let got = |phase: &str| d.by_phase.get(phase).copied().unwrap_or(0.0);
            assert!((got("forward") - forward).abs() <= 1e-9 * forward, "{schedule} {}: forward", d.id);
            let tolerance = 1e-9 * backward.max(1e-12);
            match pairing {
                Pairing::OtherStage => {
                    assert!((got("backward") - backward).abs() <= tolerance, "{schedule} {}: backward", d.id)
                }
                Pairing::OtherTask => {
                    let (b, whole) = (got("backward"), backward + hidden);
                    assert!(
                        b >= backward - tolerance && b <= whole + tolerance,
                        "{schedule} {}: {b} outside [{backward}, {whole}]",
                        d.id
                    );
                }
            }
            // the all-to-alls the timeline shows: those outside pairs
            let shown: f64 = c
                .timeline
                .events
                .iter()
                .filter(|e| e.device == d.id && matches!(stream[e.index], Instr::AllToAll { .. }))
                .map(|e| e.end - e.start)
                .sum();
            assert!((shown - exchanged).abs() <= 1e-9 * exchanged.max(1e-12), "{schedule} {}: all-to-alls", d.id);
            // what the plan reports hidden (`pipec compile` prints it)
            match pairing {
                Pairing::OtherStage => {
                    assert!((d.overlapped_s - hidden).abs() <= 1e-9 * hidden.max(1e-12), "{schedule} {}: hidden", d.id)
                }
                Pairing::OtherTask => {
                    assert!(d.overlapped_s <= hidden * (1.0 + 1e-9) + 1e-15, "{schedule} {}: hidden", d.id)
                }
            }
            saved += d.overlapped_s;
        }
        assert!(saved > 0.0, "{schedule}: no pair hid an all-to-all");
    }
}

/// Megatron-LM's combined 1F1B (`ep_overlap`) on the interleaved schedule: wherever the
/// front end accepts it (every rank has a 1F1B phase, `Pairing::combined_1f1b_obstacle`),
/// the plan verifies (no pair waits on its own forward's output downstream) and pairs
/// passes; where it refuses it (E0427), the same layout without `ep_overlap` compiles.
#[test]
fn the_combined_1f1b_compiles_wherever_the_front_end_accepts_it() {
    let mut accepted = 0;
    for ranks in 2..=4usize {
        for chunks in 2..=3usize {
            for per_replica in 1..=4 * ranks {
                let blocks = ranks * chunks;
                let text = format!(
                    "model:
  input: [8]
  layers:
    - embedding(50, 16)
    - repeat {}: transformer_block(16, 2, 32, experts=4, top_k=2)
    - linear(16, 50, bias=false)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: {}
  device: {{ memory: 64GiB, throughput: 1GFLOP/s }}
  links:
    intra_node: {{ bandwidth: 100GB/s, latency: 1us }}
strategy:
  stages: \"{}\"
  schedule: {{ kind: interleaved, virtual_stages: {chunks} }}
  microbatches: {}
  ep: 2
  ep_overlap: true
training:
  batch_size: {}
  steps: 1
  optimizer: {{ kind: sgd, lr: 0.1 }}
",
                    blocks - 2,
                    ranks * 2,
                    vec!["2"; ranks].join("-"),
                    per_replica * 2,
                    per_replica * 4,
                );
                let checked = pipec_grammar::check_source(&text);
                if checked.diagnostics.iter().any(|d| d.code == "E0405") {
                    // the interleaved schedule's own rules (microbatches per rank)
                    continue;
                }
                let obstacle = pipec_plan::schedule::Pairing::combined_1f1b_obstacle(
                    pipec_plan::ScheduleKind::Interleaved,
                    &vec![2; ranks],
                    chunks,
                    per_replica * 2,
                );
                let shape = format!("{ranks} ranks × {chunks} chunks, {per_replica} microbatches a replica");
                match (checked.spec, obstacle) {
                    (Some(_), None) => {
                        let c = build(&text);
                        let pairs = c.plan.streams.values().any(|stream| {
                            (0..stream.len()).any(|i| {
                                pipec_plan::schedule::overlapped_pair(
                                    stream,
                                    i,
                                    pipec_plan::schedule::Pairing::OtherTask,
                                )
                                .is_some()
                            })
                        });
                        assert!(pairs, "{shape}: no pair");
                        accepted += 1;
                    }
                    (None, Some(_)) => {
                        assert!(
                            checked.diagnostics.iter().any(|d| d.code == "E0427"),
                            "{shape}: {:?}",
                            checked.diagnostics
                        );
                        build(&text.replace("  ep_overlap: true\n", ""));
                    }
                    (spec, obstacle) => {
                        panic!("{shape}: front end {:?}, obstacle {obstacle:?}", spec.map(|_| "accepts"))
                    }
                }
            }
        }
    }
    assert!(accepted >= 15, "{accepted} layouts accepted");
}

#[test]
fn every_single_instruction_mutation_is_caught() {
    for (name, c) in every_schedule() {
        let streams = &c.plan.streams;
        let mut mutations = 0;
        for (dev, stream) in streams {
            for i in 0..stream.len() {
                // drop
                let mut m = streams.clone();
                m.get_mut(dev).expect("device").remove(i);
                assert!(!verify_plan(&c, &m).is_empty(), "{name}: dropping {dev}[{i}] `{}` was not caught", stream[i]);
                // duplicate
                let mut m = streams.clone();
                m.get_mut(dev).expect("device").insert(i, stream[i].clone());
                assert!(
                    !verify_plan(&c, &m).is_empty(),
                    "{name}: duplicating {dev}[{i}] `{}` was not caught",
                    stream[i]
                );
                // swap with the next instruction (a reordering), when it changes anything
                if i + 1 < stream.len() && stream[i] != stream[i + 1] && !commutes(&stream[i], &stream[i + 1]) {
                    let mut m = streams.clone();
                    m.get_mut(dev).expect("device").swap(i, i + 1);
                    assert!(
                        !verify_plan(&c, &m).is_empty(),
                        "{name}: swapping {dev}[{i}] `{}` and `{}` was not caught",
                        stream[i],
                        stream[i + 1]
                    );
                }
                mutations += 3;
            }
        }
        assert!(mutations > 0);
    }
}

/// Validation's forward-only streams: golden, clean, and every dropped, duplicated or
/// reordered instruction caught, over pipelines, replicas, tensor parallelism, virtual
/// stages and a flush-free schedule.
#[test]
fn evaluation_streams_are_golden_and_every_mutation_is_caught() {
    let layouts = [
        ("1f1b", spec(3, 4, "1f1b", 6, "straight")),
        ("hybrid-zero-1", spec(4, 4, "1f1b", 4, "\"2-2\"\n  zero: 1")),
        ("tensor-parallel", spec(4, 4, "1f1b", 4, "\"1-1\"\n  tp: 2")),
        ("interleaved", spec(2, 4, "{ kind: interleaved, virtual_stages: 2 }", 8, "straight")),
        ("pipedream", spec(4, 4, "pipedream", 6, "\"2-1-1\"")),
    ];
    for (name, text) in layouts {
        let c = build(&validated(&text));
        let eval = c.plan.eval.clone().unwrap_or_else(|| panic!("{name}: no evaluation streams"));
        assert!(pipec_compiler::verification::verify_plan(&c.plan).is_empty(), "{name}");
        let text: String = eval
            .iter()
            .map(|(dev, stream)| {
                let lines: String = stream.iter().enumerate().map(|(i, ins)| format!("  {i:4}  {ins}\n")).collect();
                format!("device {dev}:\n{lines}")
            })
            .collect();
        insta::assert_snapshot!(format!("eval_streams__{name}"), text);
        let caught = |m: std::collections::BTreeMap<DeviceId, Vec<Instr>>| {
            let mut plan = c.plan.clone();
            plan.eval = Some(m);
            !pipec_compiler::verification::verify_plan(&plan).is_empty()
        };
        for (dev, stream) in &eval {
            for i in 0..stream.len() {
                let mut m = eval.clone();
                m.get_mut(dev).expect("device").remove(i);
                assert!(caught(m), "{name}: dropping eval {dev}[{i}] `{}` was not caught", stream[i]);
                let mut m = eval.clone();
                m.get_mut(dev).expect("device").insert(i, stream[i].clone());
                assert!(caught(m), "{name}: duplicating eval {dev}[{i}] `{}` was not caught", stream[i]);
                if i + 1 < stream.len() && stream[i] != stream[i + 1] && !commutes(&stream[i], &stream[i + 1]) {
                    let mut m = eval.clone();
                    m.get_mut(dev).expect("device").swap(i, i + 1);
                    assert!(
                        caught(m),
                        "{name}: swapping eval {dev}[{i}] `{}` and `{}` was not caught",
                        stream[i],
                        stream[i + 1]
                    );
                }
            }
        }
    }
}

/// Two adjacent instructions whose order does not matter, so swapping them yields another
/// valid program rather than a bug: neither writes a buffer the other reads or writes
/// (no read-after-write, write-after-read or write-after-write dependency), they use
/// different links, they are not both collectives, and neither is an all-to-all.
fn commutes(a: &Instr, b: &Instr) -> bool {
    // an all-to-all belongs where it stands, right after its pass, in its pass's order
    if matches!(a, Instr::AllToAll { .. }) || matches!(b, Instr::AllToAll { .. }) {
        return false;
    }
    let conflict = |x: &Instr, y: &Instr| x.writes().iter().any(|w| y.reads().contains(w) || y.writes().contains(w));
    // Free ends the life of Saved: it conflicts with anything that touches Saved.
    let frees = |x: &Instr, y: &Instr| matches!(x, Instr::Free { stage, mb } if y.reads().iter().chain(y.writes().iter()).any(|b| *b == pipec_plan::Buffer::Saved { stage: *stage, mb: *mb }));
    let shared = conflict(a, b) || conflict(b, a) || frees(a, b) || frees(b, a);
    let link = |i: &Instr| match *i {
        Instr::SendActivation { peer, .. } | Instr::SendGradient { peer, .. } => Some((0, peer)),
        Instr::RecvActivation { peer, .. } | Instr::RecvGradient { peer, .. } => Some((1, peer)),
        Instr::Collective { group, .. } => Some((2, DeviceId(group.0))),
        _ => None,
    };
    let same_link = link(a).is_some() && link(a) == link(b);
    !shared && !same_link
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn verifier_accepts_every_generated_plan(d in 2usize..6, n_mult in 1usize..4, v in 2usize..4, sched in 0usize..8, extra_layers in 0usize..5, partial in 0usize..3) {
        // Chimera also with a last unit smaller than D, or fewer microbatches than D
        let n = match sched {
            7 if partial == 2 => 2,
            7 => d * n_mult + 2 * partial,
            _ => d * n_mult,
        };
        let (schedule, layers) = match sched {
            0 => ("gpipe".to_string(), d + extra_layers),
            1 => ("1f1b".to_string(), d + extra_layers),
            2 => (format!("{{ kind: interleaved, virtual_stages: {v} }}"), d * v + extra_layers),
            3 => ("pipedream".to_string(), d + extra_layers),
            4 => ("2bw".to_string(), d + extra_layers),
            5 => ("zb-h1".to_string(), d + extra_layers),
            6 => ("zbv".to_string(), 2 * d + extra_layers),
            _ => ("chimera".to_string(), d + extra_layers),
        };
        prop_assume!(sched != 7 || (d % 2 == 0 && n % 2 == 0));
        let c = build(&spec(d, n, &schedule, layers, "straight"));
        prop_assert!(verify_plan(&c, &c.plan.streams).is_empty());
        // every device finishes and every layer is in exactly one stage
        let mut covered = vec![0; layers + 1]; // the flatten, then the linear layers
        for s in &c.plan.stages {
            for c in &mut covered[s.layers[0]..s.layers[1]] {
                *c += 1;
            }
        }
        prop_assert!(covered.iter().all(|&c| c == 1));
    }

    /// Generated expert-parallel plans: clean, every pass of an expert stage posts its
    /// layers' two exchanges right after it, and every member of an expert group posts the
    /// same all-to-alls (stage, layer, exchange, size) in the same order.
    #[test]
    fn verifier_accepts_every_generated_expert_parallel_plan(
        sched in 0usize..7, two_stages in any::<bool>(), replicas in prop::sample::select(vec![2usize, 4]),
        whole_group in any::<bool>(), n_mult in 2usize..4,
    ) {
        let schedule = ["gpipe", "1f1b", "zbv", "dualpipev", "dualpipe", "chimera", "{ kind: interleaved, virtual_stages: 2 }"][sched];
        let ep = if whole_group { replicas } else { 2 };
        // the V-shaped, bidirectional and interleaved schedules need a pipeline
        let two_stages = two_stages || sched >= 2;
        let stages = if two_stages { format!("\"{replicas}-{replicas}\"") } else { format!("\"{replicas}\"") };
        let devices = replicas * if two_stages { 2 } else { 1 };
        let text = moe_spec(devices, replicas * 2 * n_mult, schedule, &stages, ep);
        let checked = pipec_grammar::check_source(&text);
        let Some(spec) = checked.spec else { return Err(TestCaseError::reject("a layout the front end refuses")) };
        let Ok(c) = compile(&spec, &CompileOptions::default()).into_compiled() else {
            return Err(TestCaseError::reject("a layout the compiler refuses"));
        };
        prop_assert!(verify_plan(&c, &c.plan.streams).is_empty());
        let mut lists: std::collections::BTreeMap<pipec_plan::GroupId, Vec<Vec<Posted>>> = Default::default();
        for stream in c.plan.streams.values() {
            let mut mine: std::collections::BTreeMap<pipec_plan::GroupId, Vec<Posted>> = Default::default();
            for (i, ins) in stream.iter().enumerate() {
                let exchanges = pipec_plan::TokenExchange::of_pass(ins.phase()).len();
                let stage = &c.plan.stages[ins.stage().0 as usize];
                let want = if stage.expert_parallel > 1 { exchanges * stage.all_to_alls.len() } else { 0 };
                let after = stream[i + 1..].iter().take_while(|x| matches!(x, Instr::AllToAll { .. })).count();
                if !matches!(ins, Instr::AllToAll { .. }) {
                    prop_assert_eq!(after, want, "`{}`", ins);
                }
                if let Instr::AllToAll { stage, layer, exchange, group, bytes, .. } = ins {
                    mine.entry(*group).or_default().push((*stage, *layer, exchange.name().to_string(), *bytes));
                }
            }
            for (g, list) in mine {
                lists.entry(g).or_default().push(list);
            }
        }
        prop_assert!(!lists.is_empty(), "no all-to-all at all");
        for (g, members) in &lists {
            prop_assert!(members.iter().all(|m| m == &members[0]), "{}: the members post different lists", g);
        }
    }
}

/// An all-to-all as its group's members must agree on it: stage, layer, exchange, bytes.
type Posted = (StageId, u32, String, u64);

/// Forwards take one unit, backwards two; communication is free.
struct TwoToOne;

impl pipec_compiler::simulate::CostModel for TwoToOne {
    fn compute(&self, _: DeviceId, instr: &Instr) -> f64 {
        match instr {
            Instr::Forward { .. } => 1.0,
            Instr::Backward { .. } => 2.0,
            _ => 0.0,
        }
    }
    fn transfer(&self, _: DeviceId, _: DeviceId, _: u64) -> f64 {
        0.0
    }
    fn collective(&self, _: pipec_plan::CollectiveKind, _: pipec_plan::GroupId, _: &[DeviceId], _: u64) -> f64 {
        0.0
    }
}

#[test]
fn flush_free_pipedream_and_2bw_have_no_bubble_in_their_steady_state() {
    use pipec_compiler::periodic::{build, steady_state, unroll, verify_periodic, PeriodicInput};
    use pipec_compiler::schedule::Placement;
    use pipec_plan::ScheduleKind;
    for d in [2usize, 4, 8] {
        let n = 2 * d;
        let placement = Placement {
            replicas: (0..d).map(|s| vec![DeviceId(s as u32)]).collect(),
            route: vec![vec![0; n]; d],
            devices: d,
            microbatches: n,
        };
        let zeros = vec![0u64; d];
        let groups = vec![None; d];
        for kind in [ScheduleKind::PipeDream, ScheduleKind::TwoBw] {
            let updates = kind.updates(d);
            let p = build(&PeriodicInput {
                kind,
                placement: &placement,
                ranks: d,
                output_bytes: &zeros,
                gradient_bytes: &zeros,
                groups: &groups,
                updates,
                recompute: &[],
                overlap: true,
            })
            .unwrap_or_else(|e| panic!("{kind} D={d}: {e}"));
            let problems = verify_periodic(&p, &placement, &Default::default(), updates.every(false), &[]);
            assert!(problems.is_empty(), "{kind} D={d}: {problems:?}");
            // the body is one step: every device runs each of the step's N microbatches'
            // forward and backward once
            for (dev, body) in &p.body {
                let fwd = body.iter().filter(|i| matches!(i, Instr::Forward { .. })).count();
                let bwd = body.iter().filter(|i| matches!(i, Instr::Backward { .. })).count();
                assert_eq!((fwd, bwd), (n, n), "{kind} D={d} {dev}");
            }
            let s = steady_state(&p, &Default::default(), &TwoToOne).expect("simulates");
            // no bubble in the steady state: N forwards and backwards of 3 units each
            assert!(s.bubble <= 0.01, "{kind} D={d}: steady-state bubble {}", s.bubble);
            assert!((s.step_time - 3.0 * n as f64).abs() < 1e-9, "{kind} D={d}: step {}", s.step_time);
            // while one flushing step keeps 1F1B's (D − 1)/(D − 1 + N) idle share
            let flush = (d as f64 - 1.0) / (d as f64 - 1.0 + n as f64);
            let one = pipec_compiler::simulate::simulate(&unroll(&p, 1), &Default::default(), &TwoToOne).expect("runs");
            assert!((one.step_time - 3.0 * (n + d - 1) as f64).abs() < 1e-9, "{kind} D={d}: {}", one.step_time);
            assert!(flush > 0.05);
        }
    }
}

#[test]
fn flush_free_pipedream_with_a_replicated_stage_is_periodic_and_verified() {
    use pipec_compiler::periodic::{build, steady_state, verify_periodic, PeriodicInput};
    use pipec_compiler::schedule::Placement;
    use pipec_plan::{GroupId, ScheduleKind};
    // PipeDream's 2-1-1: the first stage on two workers, microbatches alternating
    let n = 8;
    let placement = Placement {
        replicas: vec![vec![DeviceId(0), DeviceId(1)], vec![DeviceId(2)], vec![DeviceId(3)]],
        route: vec![(0..n).map(|m| (m % 2) as u32).collect(), vec![0; n], vec![0; n]],
        devices: 4,
        microbatches: n,
    };
    let groups = vec![Some(GroupId(0)), None, None];
    let members: std::collections::HashMap<GroupId, Vec<DeviceId>> =
        [(GroupId(0), vec![DeviceId(0), DeviceId(1)])].into_iter().collect();
    let updates = ScheduleKind::PipeDream.updates(3);
    let p = build(&PeriodicInput {
        kind: ScheduleKind::PipeDream,
        placement: &placement,
        ranks: 3,
        output_bytes: &[0; 3],
        gradient_bytes: &[0; 3],
        groups: &groups,
        updates,
        recompute: &[],
        overlap: true,
    })
    .expect("periodic");
    let problems = verify_periodic(&p, &placement, &members, updates.every(false), &[]);
    assert!(problems.is_empty(), "{problems:?}");
    // each replica runs half the step's microbatches; the steady state keeps every worker
    // busy: the replicated stage's two workers share its work, the others run all of theirs
    let s = steady_state(&p, &members, &TwoToOne).expect("simulates");
    assert!((s.step_time - 3.0 * n as f64).abs() < 1e-9, "step {}", s.step_time);
    // device 0 and 1 are half idle (each has half the microbatches of an equal stage)
    assert!((s.bubble - 0.25).abs() < 1e-9, "bubble {}", s.bubble);
}

/// Forward `f0` and backward `2·f0` on stage 0, 1 and 2 on every other stage; every
/// all-reduce takes `a`; messages are free.
struct AllReduceCost {
    f0: f64,
    a: f64,
}

impl pipec_compiler::simulate::CostModel for AllReduceCost {
    fn compute(&self, _: DeviceId, instr: &Instr) -> f64 {
        let forward = if instr.stage().0 == 0 { self.f0 } else { 1.0 };
        match instr {
            Instr::Forward { .. } => forward,
            Instr::Backward { .. } => 2.0 * forward,
            _ => 0.0,
        }
    }
    fn transfer(&self, _: DeviceId, _: DeviceId, _: u64) -> f64 {
        0.0
    }
    fn collective(&self, _: pipec_plan::CollectiveKind, _: pipec_plan::GroupId, _: &[DeviceId], _: u64) -> f64 {
        self.a
    }
}

/// PipeDream's per-update replica all-reduce overlaps the next forward. Hand-computed for
/// `2-1` with 8 microbatches: each replica of stage 0 runs 4 microbatches a step at 2 + 4,
/// and stage 1 runs 8 at 1 + 2, so with free communication the steady step is 24 with no
/// bubble. An all-reduce shorter than the forward it hides behind (a = 1.5 < 2) adds
/// nothing; a longer one (a = 3) exposes a − 2 = 1 per update, 4 updates a step: 28.
/// Waiting for every all-reduce at once instead costs the whole a per update: 24 + 4a.
#[test]
fn pipedream_hides_a_replica_all_reduce_shorter_than_the_next_forward() {
    use pipec_compiler::periodic::{build, steady_state, verify_periodic, PeriodicInput};
    use pipec_compiler::schedule::Placement;
    use pipec_plan::{GroupId, ScheduleKind};
    let n = 8;
    let placement = Placement {
        replicas: vec![vec![DeviceId(0), DeviceId(1)], vec![DeviceId(2)]],
        route: vec![(0..n).map(|m| (m % 2) as u32).collect(), vec![0; n]],
        devices: 3,
        microbatches: n,
    };
    let groups = vec![Some(GroupId(0)), None];
    let members: std::collections::HashMap<GroupId, Vec<DeviceId>> =
        [(GroupId(0), vec![DeviceId(0), DeviceId(1)])].into_iter().collect();
    let updates = ScheduleKind::PipeDream.updates(2);
    let steady = |overlap: bool, a: f64| {
        let p = build(&PeriodicInput {
            kind: ScheduleKind::PipeDream,
            placement: &placement,
            ranks: 2,
            output_bytes: &[0; 2],
            gradient_bytes: &[0; 2],
            groups: &groups,
            updates,
            recompute: &[],
            overlap,
        })
        .expect("periodic");
        let problems = verify_periodic(&p, &placement, &members, updates.every(false), &[]);
        assert!(problems.is_empty(), "{problems:?}");
        steady_state(&p, &members, &AllReduceCost { f0: 2.0, a }).expect("simulates")
    };
    for overlap in [true, false] {
        let free = steady(overlap, 0.0);
        assert!((free.step_time - 24.0).abs() < 1e-9, "free communication: step {}", free.step_time);
        assert!(free.bubble.abs() < 1e-9, "free communication: bubble {}", free.bubble);
    }
    let hidden = steady(true, 1.5);
    assert!((hidden.step_time - 24.0).abs() < 1e-9, "a = 1.5 hides: step {}", hidden.step_time);
    let (in_flight, exposed) = hidden.collectives[&DeviceId(0)];
    assert!((in_flight - 4.0 * 1.5).abs() < 1e-9 && exposed.abs() < 1e-9, "{in_flight} in flight, {exposed} exposed");
    let partly = steady(true, 3.0);
    assert!((partly.step_time - 28.0).abs() < 1e-9, "a = 3 exposes 1 per update: step {}", partly.step_time);
    let (in_flight, exposed) = partly.collectives[&DeviceId(0)];
    assert!(
        (in_flight - 12.0).abs() < 1e-9 && (exposed - 4.0).abs() < 1e-9,
        "{in_flight} in flight, {exposed} exposed"
    );
    let blocking = steady(false, 1.5);
    assert!((blocking.step_time - 30.0).abs() < 1e-9, "waiting at once: step {}", blocking.step_time);
}

/// Interleaved 1F1B with two chunks per device and every stage on two replicas: the later
/// chunk's last backward comes first, so its all-reduce starts then and runs behind the
/// earlier chunk's remaining backwards; only the first chunk's all-reduce, started by the
/// step's very last backward, is left to wait for. Hand-computed against the same schedule
/// with free communication (T): overlapped, T + a; waiting for both at the end, T + 2a.
#[test]
fn synchronous_all_reduces_start_after_their_stages_last_backward_and_overlap_the_rest() {
    use pipec_compiler::lower::{lower, LowerInput, Updates};
    use pipec_compiler::schedule::{generate, Placement};
    use pipec_compiler::simulate::{collective_times, simulate};
    use pipec_plan::{GroupId, ScheduleKind};
    let n = 4;
    let rank = |r: u32| vec![DeviceId(2 * r), DeviceId(2 * r + 1)];
    let placement = Placement {
        replicas: (0..4u32).map(|s| rank(s % 2)).collect(),
        route: vec![(0..n).map(|m| (m % 2) as u32).collect(); 4],
        devices: 4,
        microbatches: n,
    };
    let groups: Vec<Option<GroupId>> = (0..4).map(|s| Some(GroupId(s))).collect();
    let members: std::collections::HashMap<GroupId, Vec<DeviceId>> =
        (0..4u32).map(|s| (GroupId(s), rank(s % 2))).collect();
    let order = generate(ScheduleKind::Interleaved, &placement, 2, 1, false);
    let streams = |overlap: bool| {
        lower(&LowerInput {
            placement: &placement,
            order: &order,
            output_bytes: &[0; 4],
            gradient_bytes: &[0; 4],
            weight_bytes: &[0; 4],
            sharding: pipec_plan::vocab::Sharding::None,
            groups: &groups,
            updates: Updates::PerStep,
            recompute: &[],
            vertical_sync: false,
            overlap,
            pairing: None,
        })
    };
    let a = 0.5;
    let free = simulate(&streams(true), &members, &AllReduceCost { f0: 1.0, a: 0.0 }).expect("runs").step_time;
    let overlapped = simulate(&streams(true), &members, &AllReduceCost { f0: 1.0, a }).expect("runs");
    let waiting = simulate(&streams(false), &members, &AllReduceCost { f0: 1.0, a }).expect("runs");
    assert!((overlapped.step_time - (free + a)).abs() < 1e-9, "overlapped {} vs T = {free}", overlapped.step_time);
    assert!((waiting.step_time - (free + 2.0 * a)).abs() < 1e-9, "waiting {} vs T = {free}", waiting.step_time);
    // the first rank: two all-reduces in flight, one of them hidden
    let (in_flight, exposed) = collective_times(&overlapped)[&DeviceId(0)];
    assert!(
        (in_flight - 2.0 * a).abs() < 1e-9 && (exposed - a).abs() < 1e-9,
        "{in_flight} in flight, {exposed} exposed"
    );
}

/// pipec's executor draws synthetic data as training runs where the spec keeps none
/// (`samples` absent): on a device whose draws were measured (`DeviceModel::data`, the CPU's
/// `pipec calibrate`) each load is priced at its microbatch's draw — its normal inputs and
/// the teacher's scores — and the simulated step grows by the first stage's loads; a data set
/// small enough to keep, or a device without the figures, loads for nothing.
#[test]
fn a_microbatch_drawn_as_training_runs_is_priced_where_the_device_measured_the_draw() {
    let text = spec(2, 4, "gpipe", 4, "\"1-1\"");
    let compiled = |text: &str, rates: Option<pipec_plan::device::DrawRates>| {
        let checked = pipec_grammar::check_source(text);
        let mut spec = checked.spec.unwrap_or_else(|| panic!("spec has errors: {:?}", checked.diagnostics));
        spec.cluster.device.data = rates;
        compile(&spec, &CompileOptions::default()).into_compiled().expect("compiles").plan
    };
    let rates = pipec_plan::device::DrawRates { feature: 2e-6, token: 0.0, score: 1e-7 };
    let drawn = compiled(&text, Some(rates));
    let free = compiled(&text, None);
    // 4 samples a microbatch of 64 normal inputs and 64 × 64 score terms
    let load = 4.0 * (64.0 * 2e-6 + 4096.0 * 1e-7);
    let grown = drawn.simulation.step_time_s - free.simulation.step_time_s;
    assert!(grown >= 4.0 * load * 0.999 && grown <= 8.0 * load * 1.001, "the step grew by {grown} s, a load {load} s");
    let kept = text.replace("  steps: 1\n", "  steps: 1\n  data: { kind: synthetic, task: regression, samples: 64 }\n");
    assert_eq!(compiled(&kept, Some(rates)).simulation.step_time_s, compiled(&kept, None).simulation.step_time_s);
}
