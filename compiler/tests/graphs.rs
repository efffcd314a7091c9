//! Models with branches: what crosses a stage boundary that cuts a residual connection,
//! and how the plan prices it.

use pipec_compiler::{compile, ir, CompileOptions};
use pipec_plan::model::Source;
use pipec_plan::Instr;

/// Two residual blocks on 2 devices, cut after layer `cut` (the blocks are layers 1..=3 and
/// 4..=6: linear, relu, add).
fn spec(cut: usize) -> String {
    format!(
        "model:
  input: [32]
  blocks:
    res(n):
      - linear(n, n) -> relu as h
      - add(h, in)
  layers:
    - linear(32, 64) as stem
    - res(64)
    - res(64)
    - linear(64, 10)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 2
  device: {{ memory: 8GiB, throughput: 1GFLOP/s }}
  links:
    intra_node: {{ bandwidth: 1GB/s, latency: 0us }}
strategy:
  stages: \"1-1\"
  schedule: 1f1b
  microbatches: 4
  partition: [\"0..{cut}\", \"{cut}..\"]
training:
  batch_size: 16
  steps: 1
  optimizer: {{ kind: sgd, lr: 0.1 }}
"
    )
}

#[test]
fn a_boundary_inside_a_residual_block_carries_both_tensors() {
    let checked = pipec_grammar::check_source(&spec(3));
    let spec3 = checked.spec.unwrap_or_else(|| panic!("{:?}", checked.diagnostics));
    let graph = ir::lower(&spec3.model, 4);
    // after linear and relu of the first block: the block's input (the stem) and relu's output
    assert_eq!(graph.crossing(3), vec![Source::Layer(0), Source::Layer(2)]);
    assert_eq!(graph.cut_bytes_per_sample(3), 2 * 64 * 4);
    // between the blocks only the first block's output crosses
    assert_eq!(graph.crossing(4), vec![Source::Layer(3)]);
    // the plan sends both: 4 samples per microbatch x 2 tensors x 64 floats
    let plan = compile(&spec3, &CompileOptions::default()).into_compiled().expect("compiles").plan;
    let sent: Vec<u64> = plan
        .streams
        .values()
        .flatten()
        .filter_map(|i| match i {
            Instr::SendActivation { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    assert_eq!(sent, vec![4 * 2 * 64 * 4; 4]);
    // the plan lists the operands of the layers that do not just read the one before (the
    // two adds), and its own check accepts the graph
    let listed: Vec<(usize, Vec<Source>)> =
        plan.layers.iter().filter_map(|l| l.inputs.clone().map(|i| (l.index, i))).collect();
    assert_eq!(
        listed,
        vec![(3, vec![Source::Layer(2), Source::Layer(0)]), (6, vec![Source::Layer(5), Source::Layer(3)])]
    );
    assert!(plan.check().is_empty(), "{:?}", plan.check());
    // a plan whose layer reads a later layer is malformed
    let mut bad = plan.clone();
    bad.layers[3].inputs = Some(vec![Source::Layer(2), Source::Layer(5)]);
    assert!(bad.check().iter().any(|p| p.contains("does not come before")), "{:?}", bad.check());
}

/// The bytes crossing every cut, computed once per graph in one pass, are the bytes of the
/// tensors `crossing` lists there, on every example model (chains, residual blocks,
/// inception's branches, tied language models, the LSTM).
#[test]
fn every_cuts_bytes_are_those_of_the_tensors_crossing_it() {
    let mut graphs = 0;
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../specs")).expect("specs") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        let Some(spec) = pipec_grammar::check_source_in(&text, path.parent()).spec else { continue };
        let graph = ir::lower(&spec.model, 4);
        for cut in 0..=graph.len() {
            let listed: u64 = graph.crossing(cut).iter().map(|&s| graph.source_bytes(s)).sum();
            assert_eq!(graph.cut_bytes_per_sample(cut), listed, "{}: cut {cut}", path.display());
        }
        graphs += 1;
    }
    assert!(graphs >= 15, "only {graphs} example specs checked");
}
