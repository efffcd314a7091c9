//! pipec's GPipe, 1F1B and interleaved compute orders equal PyTorch's
//! (`torch.distributed.pipelining`, dumped into tests/reference/torch/): exactly with
//! `overlap: false`, and with the default `overlap` once every backward of a later stage,
//! which pipec splits so that its input gradient goes out first, is read as PyTorch's one
//! backward (`B`) expanded into its input (`I`) and weight (`W`) passes, back to back.

use std::path::Path;

use pipec_compiler::lower::compute_order;
use pipec_compiler::{compile, CompileOptions};

fn spec(ranks: usize, microbatches: usize, schedule: &str, layers: usize, overlap: bool) -> String {
    format!(
        "model:\n  input: [8]\n  layers:\n    - repeat {layers}: linear(8, 8)\n  loss: mse\ncluster:\n  nodes: 1\n  devices_per_node: {ranks}\n  device: {{ memory: 1GiB, throughput: 1GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 1GB/s, latency: 1us }}\nstrategy:\n  stages: straight\n  schedule: {schedule}\n  microbatches: {microbatches}\n  overlap: {overlap}\ntraining:\n  batch_size: {}\n  steps: 1\n  optimizer: {{ kind: sgd, lr: 0.1 }}\n",
        microbatches * 2
    )
}

#[test]
fn compute_orders_match_pytorch() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/torch");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("reference dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        let ranks = r["ranks"].as_u64().expect("ranks") as usize;
        let stages = r["stages"].as_u64().expect("stages") as usize;
        let mbs = r["microbatches"].as_u64().expect("microbatches") as usize;
        let schedule = match r["schedule"].as_str().expect("schedule") {
            "ScheduleGPipe" => "gpipe".to_string(),
            "Schedule1F1B" => "1f1b".to_string(),
            "ScheduleInterleaved1F1B" => format!("{{ kind: interleaved, virtual_stages: {} }}", stages / ranks),
            other => panic!("unexpected schedule {other}"),
        };
        for overlap in [false, true] {
            let text = spec(ranks, mbs, &schedule, stages, overlap);
            let s = pipec_grammar::check_source(&text).spec.expect("valid spec");
            let plan = compile(&s, &CompileOptions::default()).into_compiled().expect("compiles").plan;
            for (rank, stream) in plan.streams.values().enumerate() {
                let ours: Vec<String> = compute_order(stream).iter().map(ToString::to_string).collect();
                let theirs: Vec<String> = r["order"][rank.to_string()]
                    .as_array()
                    .expect("rank order")
                    .iter()
                    .map(|a| a.as_str().expect("action").to_string())
                    .flat_map(|a| match a.split_once('B') {
                        // `1B3`: stage 1's backward of microbatch 3
                        Some((stage, mb)) if overlap && stage != "0" => {
                            vec![format!("{stage}I{mb}"), format!("{stage}W{mb}")]
                        }
                        _ => vec![a],
                    })
                    .collect();
                assert_eq!(ours, theirs, "{} (overlap: {overlap}): rank {rank}", path.display());
            }
        }
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} reference files");
}

/// Every case of a reference file of DeepSeek's orders (tests/reference/dualpipev/, written
/// by make_orders.py from the reference implementation's `step`) against pipec's plan of
/// `schedule` on as many devices, `layers(ranks)` linear layers, each `overlap` given.
fn assert_deepseeks_orders(file: &str, schedule: &str, layers: fn(usize) -> usize, overlaps: &[bool], at_least: usize) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/dualpipev").join(file);
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    let cases = r["cases"].as_array().expect("cases");
    assert!(cases.len() >= at_least, "{file}: {} cases", cases.len());
    for case in cases {
        let ranks = case["ranks"].as_u64().expect("ranks") as usize;
        let mbs = case["microbatches"].as_u64().expect("microbatches") as usize;
        for &overlap in overlaps {
            let text = spec(ranks, mbs, schedule, layers(ranks), overlap);
            let s = pipec_grammar::check_source(&text).spec.expect("valid spec");
            let plan = compile(&s, &CompileOptions::default()).into_compiled().expect("compiles").plan;
            assert_eq!(plan.streams.len(), ranks);
            for (rank, stream) in plan.streams.values().enumerate() {
                let ours: Vec<String> = compute_order(stream).iter().map(ToString::to_string).collect();
                let theirs: Vec<String> = case["orders"][rank]
                    .as_array()
                    .expect("rank order")
                    .iter()
                    .map(|a| a.as_str().expect("action").to_string())
                    .collect();
                assert_eq!(ours, theirs, "{schedule} R={ranks} N={mbs} (overlap: {overlap}): rank {rank}");
            }
        }
    }
}

/// pipec's DualPipe orders equal DeepSeek's reference implementation's (`DualPipe.step`)
/// on 2, 4 and 6 devices.
#[test]
fn dualpipe_orders_match_deepseeks_reference() {
    assert_deepseeks_orders("dualpipe-orders.json", "dualpipe", |ranks| 2 * ranks, &[false], 9);
}

/// pipec's DualPipeV orders equal DeepSeek's reference implementation's (`DualPipeV.step`),
/// on 2 to 4 devices from the fewest microbatches the schedule takes (2 per device) up; with
/// and without `overlap` (DualPipeV splits its backwards itself, so `overlap` changes
/// nothing).
#[test]
fn dualpipev_orders_match_deepseeks_reference() {
    assert_deepseeks_orders("orders.json", "dualpipev", |ranks| 4 * ranks, &[false, true], 12);
}
