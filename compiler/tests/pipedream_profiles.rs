//! PipeDream's published profiles (tests/reference/pipedream-profiles, MIT) as
//! `pipec plan-profile` reads them.

use pipec_compiler::cost::{parse_pipedream_profile, pipedream_cut_bytes, PipeDreamNode};

fn profile(model: &str) -> Vec<PipeDreamNode> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/pipedream-profiles/").to_string()
        + model
        + "/graph.txt";
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    parse_pipedream_profile(&text).unwrap_or_else(|e| panic!("{model}: {e}"))
}

const MODELS: [&str; 14] = [
    "alexnet",
    "vgg16",
    "squeezenet1_0",
    "resnet18",
    "resnet50",
    "resnext50",
    "inception_v3",
    "resnet101",
    "resnext101",
    "densenet121",
    "nasnetamobile",
    "nasnetalarge",
    "gnmt",
    "gnmt_large",
];

#[test]
fn every_published_profile_loads_with_its_input_zeroed() {
    for model in MODELS {
        let nodes = profile(model);
        assert!(nodes.len() > 5, "{model}: {} nodes", nodes.len());
        for n in &nodes {
            let values = [n.forward_ms, n.backward_ms, n.activation_size, n.parameter_size];
            assert!(values.iter().all(|v| v.is_finite() && *v >= 0.0), "{model} {}: {values:?}", n.id);
            assert!(n.successors.iter().all(|&s| s < nodes.len()));
        }
        // data loading is not a layer: PipeDream's optimizer gives the Input node no time
        let inputs: Vec<&PipeDreamNode> = nodes.iter().filter(|n| n.description.starts_with("Input")).collect();
        assert!(!inputs.is_empty(), "{model}: no Input node");
        assert!(inputs.iter().all(|n| n.forward_ms == 0.0 && n.backward_ms == 0.0), "{model}");
    }
}

#[test]
fn gnmt_lists_of_output_sizes_are_summed() {
    let lstm = profile("gnmt").into_iter().find(|n| n.id == "node7").expect("node7");
    assert_eq!(lstm.activation_size, 6291456.0 + 131072.0 + 131072.0);
}

#[test]
fn a_cut_is_charged_every_edge_that_crosses_it() {
    // a -> b -> c with a skip a -> c: a cut between b and c carries a's and b's outputs
    let text = "node1 -- Input0 -- forward_compute_time=1.0, backward_compute_time=0.0, activation_size=10.0, parameter_size=0.0\n\
                node2 -- Conv -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=20.0, parameter_size=4.0\n\
                node3 -- Add -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=30.0, parameter_size=0.0\n\
                \tnode1 -- node2\n\tnode2 -- node3\n\tnode1 -- node3\n";
    let nodes = parse_pipedream_profile(text).expect("parses");
    assert_eq!(pipedream_cut_bytes(&nodes), vec![10.0, 30.0, 0.0]);
    // ResNet-18: inside a residual block the cut carries the block's input as well
    let resnet = profile("resnet18");
    let cuts = pipedream_cut_bytes(&resnet);
    let more = (1..resnet.len()).filter(|&j| cuts[j - 1] > resnet[j - 1].activation_size).count();
    assert!(more > 0, "no cut inside a block carries more than the last layer's output");
}
