//! `pipec plan-profile`: run the `auto` planner on a measured profile alone — pipec's JSON
//! profile or PipeDream's `graph.txt` — for a cluster given on the command line, without a
//! spec. This is how published profiles (e.g. PipeDream's VGG-16) are planned and compared.

use std::path::Path;
use std::time::Instant;

use pipec_compiler::cost::{parse_pipedream_profile, pipedream_costs, pipedream_cut_bytes, LayerCost, Profile};
use pipec_compiler::partition::{auto, AutoInput};
use pipec_grammar::dsl::{lookup_unit, parse_quantity, Dimension};

use crate::{EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// The cluster and run figures the planner needs.
#[derive(Debug, Clone)]
pub struct PlanProfileArgs {
    pub nodes: usize,
    pub devices_per_node: usize,
    pub intra: String,
    pub inter: String,
    pub memory: String,
    /// Samples the profile's times cover (PipeDream's profiles: the minibatch, 64 for VGG).
    pub batch: usize,
    pub microbatches: usize,
}

fn quantity(text: &str, dim: Dimension, what: &str) -> Result<f64, String> {
    let q = parse_quantity(text).map_err(|e| format!("--{what} `{text}`: expected {}", e.expected))?;
    match lookup_unit(&q.unit) {
        Some((d, f)) if d == dim => Ok(q.number * f),
        _ => Err(format!("--{what} `{text}`: expected {}", dim.describe())),
    }
}

pub fn run(file: &Path, a: &PlanProfileArgs) -> u8 {
    let text = match crate::check_cmd::read_text(file, crate::check_cmd::MAX_PLAN_BYTES, false) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    // the bytes crossing a cut after each layer, per minibatch: a pipec profile is a chain
    // (a layer's output), a PipeDream graph sums every edge that crosses
    let (names, costs, cuts): (Vec<String>, Vec<LayerCost>, Vec<f64>) = if text.trim_start().starts_with('{') {
        let profile: Profile = match serde_json::from_str(&text) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: `{}` is not a pipec profile: {e}", file.display());
                return EXIT_USAGE;
            }
        };
        let costs: Vec<LayerCost> = profile
            .layers
            .iter()
            .map(|l| LayerCost {
                forward_flops_per_sample: 0.0,
                backward_flops_per_sample: 0.0,
                forward_s: l.forward_ms / 1e3,
                backward_s: l.backward_ms / 1e3,
                parameters: l.parameter_bytes / 4,
                parameter_bytes: l.parameter_bytes,
                activation_bytes_per_sample: l.activation_bytes / profile.batch_size.max(1) as u64,
                output_bytes_per_sample: l.output_bytes / profile.batch_size.max(1) as u64,
            })
            .collect();
        let cuts = costs.iter().map(|c: &LayerCost| c.output_bytes_per_sample as f64 * a.batch as f64).collect();
        (profile.layers.iter().map(|l| l.name.clone()).collect(), costs, cuts)
    } else {
        match parse_pipedream_profile(&text) {
            Ok(nodes) => (
                nodes.iter().map(|n| n.description.clone()).collect(),
                pipedream_costs(&nodes, a.batch, a.batch),
                pipedream_cut_bytes(&nodes),
            ),
            Err(e) => {
                eprintln!("error: `{}`: {e}", file.display());
                return EXIT_USAGE;
            }
        }
    };
    let parsed = (|| -> Result<(f64, f64, f64), String> {
        Ok((
            quantity(&a.intra, Dimension::Bandwidth, "intra")?,
            quantity(&a.inter, Dimension::Bandwidth, "inter")?,
            quantity(&a.memory, Dimension::Bytes, "memory")?,
        ))
    })();
    let (intra, inter, memory) = match parsed {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    if a.nodes == 0 || a.devices_per_node == 0 || costs.is_empty() {
        eprintln!("error: need at least one node, one device per node and one layer");
        return EXIT_USAGE;
    }
    let times: Vec<f64> = costs.iter().map(|c| c.forward_s + c.backward_s).collect();
    let params: Vec<f64> = costs.iter().map(|c| c.parameter_bytes as f64).collect();
    // weights, gradients and one optimizer copy; activations for the in-flight microbatches
    let memory_per_layer: Vec<f64> = costs
        .iter()
        .map(|c| c.parameter_bytes as f64 * 3.0 + c.activation_bytes_per_sample as f64 * a.batch as f64)
        .collect();
    let input = AutoInput {
        layer_times: &times,
        parameter_bytes: &params,
        cut_bytes: &cuts,
        memory_bytes: &memory_per_layer,
        machines: a.nodes * a.devices_per_node,
        machines_per_node: a.devices_per_node,
        memory_capacity: memory,
        microbatches: a.microbatches.max(1),
        intra: (intra, 0.0),
        inter: (inter, 0.0),
    };
    let start = Instant::now();
    let Some(plan) = auto(&input) else {
        eprintln!("error: no partition fits in {} per device", a.memory);
        return EXIT_DIAGNOSTICS;
    };
    let took = start.elapsed().as_secs_f64();
    let single: f64 = times.iter().sum();
    println!(
        "{} layers, {} node(s) x {} device(s); one device: {:.2} ms per minibatch",
        costs.len(),
        a.nodes,
        a.devices_per_node,
        single * 1e3
    );
    println!("partition: {}", plan.notation());
    for (s, (r, m)) in plan.ranges.iter().zip(&plan.replicas).enumerate() {
        let t: f64 = times[r.clone()].iter().sum();
        println!(
            "  stage {s}: layers {}..{} ({} .. {}) on {m} device(s), {:.2} ms per minibatch",
            r.start,
            r.end,
            names[r.start],
            names[r.end - 1],
            t * 1e3
        );
    }
    println!(
        "predicted time per minibatch: {:.2} ms ({:.2}x one device); planned in {:.4} s",
        plan.time_per_microbatch * 1e3,
        single / plan.time_per_microbatch,
        took
    );
    EXIT_OK
}
