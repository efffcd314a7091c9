//! `pipec plan-profile`: run the `auto` planner on a measured profile alone — pipec's JSON
//! profile or PipeDream's `graph.txt` — for a cluster given on the command line, without a
//! spec. This is how published profiles (e.g. PipeDream's VGG-16) are planned and compared.

use std::path::Path;
use std::time::Instant;

use pipec_compiler::cost::Profile;
use pipec_compiler::partition::{auto, LayerChain, Machines, WeightSync};
use pipec_compiler::pipedream::{self, parse_pipedream_profile};
use pipec_grammar::dsl::{lookup_unit, parse_quantity, Dimension};
use pipec_grammar::spec::Link;

use crate::{EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// The cluster and run figures the planner needs.
#[derive(Debug, Clone)]
pub struct PlanProfileArgs {
    pub nodes: usize,
    pub devices_per_node: usize,
    pub intra: String,
    pub inter: String,
    pub memory: String,
    /// Samples per unit of work for a pipec profile (its times are scaled to it).
    pub batch: usize,
    pub microbatches: usize,
    pub sync: SyncArg,
}

/// `--sync`: how replicated stages keep their weights in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyncArg {
    /// PipeDream's for a PipeDream graph, an all-reduce per step for a pipec profile.
    Auto,
    /// PipeDream's: each replica exchanges weights after every minibatch it trains.
    Pipedream,
    /// One ring all-reduce per step of `--microbatches` microbatches.
    AllReduce,
}

pub(crate) fn quantity(text: &str, dim: Dimension, what: &str) -> Result<f64, String> {
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
    // pipec's profile is a chain timed per `batch_size` samples (a microbatch of `--batch`);
    // PipeDream's graph is timed per minibatch, and a cut carries every edge that crosses it
    let pipedream_graph = !text.trim_start().starts_with('{');
    let chain: LayerChain = if pipedream_graph {
        match parse_pipedream_profile(&text) {
            Ok(nodes) => pipedream::chain(&nodes),
            Err(e) => {
                eprintln!("error: `{}`: {e}", file.display());
                return EXIT_USAGE;
            }
        }
    } else {
        let profile: Profile = match serde_json::from_str(&text) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("error: `{}` is not a pipec profile: {e}", file.display());
                return EXIT_USAGE;
            }
        };
        let scale = a.batch as f64 / profile.batch_size.max(1) as f64;
        let l = &profile.layers;
        LayerChain {
            names: l.iter().map(|l| l.name.clone()).collect(),
            times: l.iter().map(|l| (l.forward_ms + l.backward_ms) / 1e3 * scale).collect(),
            parameter_bytes: l.iter().map(|l| l.parameter_bytes as f64).collect(),
            cut_bytes: l.iter().map(|l| l.output_bytes as f64 * scale).collect(),
            memory_bytes: l
                .iter()
                .map(|l| 3.0 * l.parameter_bytes as f64 + l.activation_bytes as f64 * scale)
                .collect(),
        }
    };
    let sync = match a.sync {
        SyncArg::Pipedream => WeightSync::PipeDream,
        SyncArg::AllReduce => WeightSync::PerStep { microbatches: a.microbatches.max(1) },
        SyncArg::Auto if pipedream_graph => WeightSync::PipeDream,
        SyncArg::Auto => WeightSync::PerStep { microbatches: a.microbatches.max(1) },
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
    if a.nodes == 0 || a.devices_per_node == 0 || chain.times.is_empty() {
        eprintln!("error: need at least one node, one device per node and one layer");
        return EXIT_USAGE;
    }
    let machines = Machines {
        nodes: a.nodes,
        per_node: a.devices_per_node,
        memory_capacity: memory,
        intra: Link::new(intra, 0.0),
        inter: Link::new(inter, 0.0),
    };
    let input = chain.input(&machines, sync);
    let start = Instant::now();
    let Some(plan) = auto(&input) else {
        eprintln!("error: no partition fits in {} per device", a.memory);
        return EXIT_DIAGNOSTICS;
    };
    let took = start.elapsed().as_secs_f64();
    let single: f64 = chain.times.iter().sum();
    let unit = if pipedream_graph { "minibatch" } else { "microbatch" };
    println!(
        "{} layers, {} node(s) x {} device(s); one device: {:.2} ms per {unit}",
        chain.times.len(),
        a.nodes,
        a.devices_per_node,
        single * 1e3
    );
    println!(
        "weight sync: {}",
        match sync {
            WeightSync::PipeDream =>
                "PipeDream's (every replica exchanges 4(m-1)/m of the stage's weights per minibatch it trains)"
                    .to_string(),
            WeightSync::PerStep { microbatches } => format!("one ring all-reduce per {microbatches} microbatch(es)"),
        }
    );
    println!("partition: {}", plan.notation());
    for (s, (r, m)) in plan.ranges.iter().zip(&plan.replicas).enumerate() {
        let t: f64 = chain.times[r.clone()].iter().sum();
        println!(
            "  stage {s}: layers {}..{} ({} .. {}) on {m} device(s), {:.2} ms compute per {unit}",
            r.start,
            r.end,
            chain.names[r.start],
            chain.names[r.end - 1],
            t * 1e3
        );
    }
    println!(
        "predicted time per {unit}: {:.2} ms ({:.2}x one device); planned in {:.4} s",
        plan.time_per_microbatch * 1e3,
        single / plan.time_per_microbatch,
        took
    );
    EXIT_OK
}
