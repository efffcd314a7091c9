//! The `pipec` command line: `check`, `compile`, `run`, `profile`, `explain`, `schema`,
//! `lsp` and `launch`. Each subcommand is a thin driver over the library crates.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod calibrate_cmd;
mod calibrate_measured;
mod check_cmd;
mod compare_cmd;
mod compile_cmd;
mod elastic;
mod emit_cmd;
mod export_cmd;
mod import_cmd;
mod launch_cmd;
mod lsp;
mod lsp_io;
/// Atomic file writing, shared with the executor (`pipec_plan::output`).
use pipec_plan::output;
mod plan_profile_cmd;
mod profile_cmd;
mod progress;
mod run_cmd;
mod run_speed;
mod search_cmd;
mod this_cpu;

/// Exit codes, documented in README.md.
pub const EXIT_OK: u8 = 0;
pub const EXIT_DIAGNOSTICS: u8 = 1;
pub const EXIT_USAGE: u8 = 2;

#[derive(Parser)]
#[command(name = "pipec", version, about = "A compiler for distributed deep-learning training", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Output format of diagnostics.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Format {
    /// Graphical report (colour only on a terminal).
    Human,
    /// One JSON object per diagnostic per line.
    Json,
}

/// The engines `pipec import --engine` plans a Hugging Face model for.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ImportEngine {
    /// torchtitan, eager PyTorch.
    Torchtitan,
    /// torchtitan with `torch.compile` on each block.
    TorchtitanCompiled,
    /// Megatron-LM on Transformer Engine.
    Megatron,
    /// DeepSpeed over the model's PyTorch modules.
    Deepspeed,
    /// pipec's own executor (`pipec run`).
    Pipec,
}

impl ImportEngine {
    /// The spec's `engine:` value.
    fn spec_value(self) -> &'static str {
        match self {
            ImportEngine::Torchtitan => "torchtitan",
            ImportEngine::TorchtitanCompiled => "{ name: torchtitan, compile: true }",
            ImportEngine::Megatron => "megatron",
            ImportEngine::Deepspeed => "deepspeed",
            ImportEngine::Pipec => "pipec",
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Check specs statically and report every problem with its location.
    Check {
        /// Spec files to check.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Write a spec for a Hugging Face model's `config.json` (saved by transformers 4.x or
    /// 5.x; GPT-2, Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE; BERT as a sequence classifier): its `model`
    /// section as pipec layers, with the cluster of the flags below, an `auto` strategy and a
    /// training section to edit; or for an engine's launch configuration (a Megatron-LM
    /// argument list or script, a torchtitan TOML, a DeepSpeed ds_config.json with
    /// --model-config) with the layout it describes. A field pipec cannot honour is an error
    /// naming it and why.
    Import {
        config: PathBuf,
        /// Where to write the spec (default: standard output).
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// The training window in tokens (default: the model's context, at most 4096).
        #[arg(long)]
        seq: Option<usize>,
        /// The spec's `name` (default: the config's folder).
        #[arg(long)]
        name: Option<String>,
        /// The engine a Hugging Face model is planned for: its kernels price the step, its
        /// capabilities bound the search, `pipec emit` writes its configuration (`pipec`:
        /// pipec's own executor) [default: torchtitan; deepspeed for BERT]
        #[arg(long, value_enum)]
        engine: Option<ImportEngine>,
        /// The cluster's nodes.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
        nodes: u64,
        /// Devices per node.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
        devices_per_node: u64,
        /// The device preset (h100-sxm, h200, b200, a100-80gb, a100-40gb, v100-32gb,
        /// v100-16gb); the interconnect is its DGX system's.
        #[arg(long, default_value = "h100-sxm")]
        device: String,
        /// The GPUs an engine's configuration runs on, when it does not say (torchtitan,
        /// DeepSpeed, a Megatron-LM argument list without `--nproc_per_node`).
        #[arg(long)]
        gpus: Option<usize>,
        /// With a DeepSpeed ds_config.json: the Hugging Face config.json of its model.
        #[arg(long)]
        model_config: Option<PathBuf>,
    },
    /// Write a checkpoint as a Hugging Face checkpoint folder (`model.safetensors` under
    /// `transformers`' names and `config.json`) for a GPT-2, Llama-family or BERT model, or a
    /// ResNet's `model.safetensors` under torchvision's names, whatever layout trained it.
    Export {
        /// A checkpoint: a step directory, a checkpoints directory or a run directory.
        checkpoint: PathBuf,
        /// The folder to write (must not exist).
        #[arg(short, long)]
        out: PathBuf,
        /// The run's plan.json (default: the nearest one above the checkpoint).
        #[arg(long)]
        plan: Option<PathBuf>,
    },
    /// Write a plan as another engine's launch configuration: Megatron-LM's pretrain_gpt.py
    /// arguments and a Slurm script, torchtitan's TOML job config and torchrun line, or
    /// DeepSpeed's ds_config.json and launcher line, with pipec's prediction for the run.
    Emit {
        /// A spec (.yaml, compiled here) or a plan.json.
        input: PathBuf,
        /// The engine (default: the spec's `engine:`).
        #[arg(long, value_parser = parse_engine)]
        engine: Option<pipec_plan::vocab::Engine>,
        /// The folder to write (must not exist).
        #[arg(short, long)]
        out: PathBuf,
    },
    /// Print the long explanation of a diagnostic code, e.g. `pipec explain E0102`.
    Explain {
        /// The code (`E0102`); `--list` lists all codes.
        code: Option<String>,
        #[arg(long)]
        list: bool,
    },
    /// Print the JSON Schema of the spec format.
    Schema,
    /// Plan a measured profile alone (pipec's profile JSON or PipeDream's graph.txt) with the
    /// `auto` planner on a cluster given by flags.
    PlanProfile {
        file: PathBuf,
        #[arg(long, default_value_t = 1)]
        nodes: usize,
        #[arg(long)]
        devices_per_node: usize,
        /// Bandwidth inside a node, e.g. `8GB/s`.
        #[arg(long)]
        intra: String,
        /// Bandwidth between nodes, e.g. `10Gbps`.
        #[arg(long)]
        inter: String,
        /// Memory per device.
        #[arg(long, default_value = "16GB")]
        memory: String,
        /// Samples per microbatch, for a pipec profile (its times are scaled to it; a
        /// PipeDream graph is planned per minibatch as profiled).
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Microbatches per step, for `--sync all-reduce`.
        #[arg(long, default_value_t = 1)]
        microbatches: usize,
        /// How replicated stages keep their weights in step.
        #[arg(long, value_enum, default_value_t = plan_profile_cmd::SyncArg::Auto)]
        sync: plan_profile_cmd::SyncArg,
    },
    /// Run the language server on standard input/output (diagnostics, hover, completion,
    /// quick fixes for spec files).
    Lsp,
    /// Measure this machine's device (matrix products, element-wise kernels, launch) and
    /// write the device file a spec names with `cluster.device: { file: FILE }`.
    Calibrate {
        /// Output file (default: device.json; with --measured, calibration.json).
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Instead of measuring this machine: fit the engine's kernel efficiency on SPEC's
        /// device kind to one measured step of that spec's own run (--step or --log), and
        /// write the calibration file a spec names with `engine: { calibration: FILE }`.
        #[arg(long, value_name = "SPEC")]
        measured: Option<PathBuf>,
        /// With --measured: the measured seconds per step (`2.84`, `2840ms`).
        #[arg(long, requires = "measured")]
        step: Option<String>,
        /// With --measured: the run's log — Megatron-LM's (`elapsed time per iteration
        /// (ms)`), torchtitan's (`tps`) or `pipec run`'s metrics.jsonl.
        #[arg(long, requires = "measured")]
        log: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = run_cmd::Backend::Cpu)]
        backend: run_cmd::Backend,
        /// The device's memory, written into the file (e.g. `16GiB`).
        #[arg(long, default_value = "16GiB")]
        memory: String,
        /// Timed repetitions per measured kernel (the median is kept).
        #[arg(long, default_value_t = 15)]
        reps: usize,
        /// CPU: measure with this many copies running at once, as a plan's devices share the
        /// machine (its worker threads); name the file in specs of that many devices
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
        concurrent: u64,
    },
    /// Measure every layer's forward and backward on a backend; writes the profile
    /// `pipec compile --profile` accepts.
    Profile {
        /// A spec (.yaml) or a plan.json.
        file: PathBuf,
        /// Output file (default: out/<job name>/profile.json).
        #[arg(short, long)]
        out: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = run_cmd::Backend::Cpu)]
        backend: run_cmd::Backend,
        /// Measured repetitions per layer (the median is kept; a forward's, of groups of as
        /// many forwards as a weight version serves in a step).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// CPU: measure with this many copies running at once, as the plan's worker threads
        /// will share the machine (default: the plan's devices, at most the cores).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
        concurrent: Option<u64>,
    },
    /// Compile (or load a plan.json) and train: DIR/metrics.jsonl, trace.json, checkpoints.
    Run(run_cmd::RunArgs),
    /// Print (and with --exec run) the mpirun command that trains the plan with one
    /// process per device.
    Launch {
        file: PathBuf,
        /// An Open MPI hostfile (`host slots=N` lines); each host's slots must equal the
        /// spec's devices_per_node.
        #[arg(long)]
        hostfile: Option<PathBuf>,
        /// Output directory passed to `pipec run`.
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Run the command instead of only printing it.
        #[arg(long)]
        exec: bool,
        /// Seconds a rank may wait for a message before the job is stopped (passed to
        /// `pipec run --timeout`).
        #[arg(long)]
        timeout: Option<u64>,
        /// With --exec: seconds every rank has to start (Open MPI reaching every host and
        /// starting its processes); past them mpirun is stopped and the hosts that do not
        /// answer are named.
        #[arg(long, default_value_t = 120)]
        start_timeout: u64,
        /// With --exec: when a rank or a host is lost, plan again for the devices left (the
        /// spec's strategy if it still applies, else the search), resume from the newest
        /// checkpoint and go on (needs `training.checkpoint`).
        #[arg(long, requires = "exec")]
        elastic: bool,
        /// With --elastic: stop when fewer devices than this are left.
        #[arg(long, default_value_t = 1, requires = "elastic")]
        min_devices: usize,
        /// With --elastic: restarts allowed before a failure ends the job.
        #[arg(long, default_value_t = 3, requires = "elastic")]
        max_restarts: usize,
        /// Start the ranks with Slurm's `srun` (PMIx) instead of `mpirun`: the hosts are
        /// the allocation's.
        #[arg(long, conflicts_with = "hostfile")]
        slurm: bool,
    },
    /// Compile a spec into a verified, simulated plan: DIR/plan.json, timeline.svg,
    /// memory.svg and trace.json.
    Compile {
        file: PathBuf,
        /// Output directory (default: out/<spec name>).
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Also print one form of the result on standard output.
        #[arg(long, value_enum)]
        emit: Option<compile_cmd::Emit>,
        /// A measured per-layer profile (from `pipec profile`) replacing analytic costs.
        #[arg(long)]
        profile: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
        /// Show what resuming this plan from a checkpoint would move between devices.
        #[arg(long)]
        resume: Option<PathBuf>,
    },
    /// Search every strategy for the spec's model on its cluster (tensor-parallel degree,
    /// pipeline depth × data parallelism, schedule, microbatches, recompute), ranked by the
    /// predicted step under every device's memory; prints the best as a `strategy` to paste,
    /// the runner-ups and why they lost. A written strategy is ignored; an `auto` one keeps
    /// its pinned fields and `search:` constraints, which the options below override.
    Search {
        file: PathBuf,
        /// A measured per-layer profile (from `pipec profile`) replacing analytic costs.
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Also consider the asynchronous schedules (pipedream, 2bw: stale weights).
        #[arg(long = "async")]
        allow_async: bool,
        /// The most pipeline stages to consider.
        #[arg(long)]
        max_depth: Option<usize>,
        /// Memory headroom every device must keep, in percent of its capacity (default: the
        /// spec's `search: headroom`, or 10%: the allocator's reserve, CUDA's context and NCCL's buffers).
        #[arg(long)]
        headroom: Option<f64>,
        /// Only these schedules, e.g. `--schedules 1f1b,interleaved`.
        #[arg(long, value_delimiter = ',')]
        schedules: Vec<String>,
        /// How many plans to list: the best, and runner-ups among the plans simulated on
        /// the way to it.
        #[arg(long, default_value_t = 5)]
        top: usize,
        /// Find the --top plans exactly (the runner-ups are then the next best of the whole
        /// space, at the cost of simulating more candidates).
        #[arg(long)]
        exact_top: bool,
        /// `human`: the report with the strategy to paste; `json`: the same report as one JSON
        /// object (the best and the runner-ups with their predicted step, bubble and headroom,
        /// or `none_because`, and the counts of candidates considered, invalid, too big,
        /// pruned and simulated). Diagnostics stay on standard error either way.
        #[arg(long, value_enum, default_value_t = Format::Human, hide_possible_values = true)]
        format: Format,
    },
    /// Compile the spec under every schedule and print their predicted step time, bubble,
    /// throughput and memory headroom side by side (nothing is written).
    Compare {
        file: PathBuf,
        /// A measured per-layer profile (from `pipec profile`) replacing analytic costs.
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Also sweep the microbatch count, e.g. `--microbatches 4,8,16` (the batch stays).
        #[arg(long, value_delimiter = ',')]
        microbatches: Vec<usize>,
        /// `human`: a table; `json`: one JSON object per schedule per line.
        #[arg(long, value_enum, default_value_t = Format::Human, hide_possible_values = true)]
        format: Format,
    },
}

/// mimalloc instead of glibc's malloc: training steps 15-25% faster on the CPU backend
/// (the executor allocates and frees large tensors on every op; see docs/benchmarks.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc 3's `mi_option_purge_delay` (`c_src/mimalloc/v3/include/mimalloc.h` of
/// libmimalloc-sys 0.1.49, whose Rust bindings do not name it).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

#[allow(unsafe_code)]
mod allocator {
    extern "C" {
        pub fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
        #[cfg(test)]
        pub fn mi_option_get(option: std::ffi::c_int) -> std::ffi::c_long;
    }
}

/// Keeps the memory a step frees for the next step's tensors instead of handing it back to
/// the system (mimalloc's purge delay -1: "no purging at all"), unless `MIMALLOC_PURGE_DELAY`
/// says otherwise. mimalloc's default (1,000 ms) returned the pages of a step's large tensors
/// and faulted them in zeroed again: 19% of a `tp: 2` run's samples in the kernel's page
/// clearing; `farm-bench -n 6`, whole runs of `bench/specs/tp-cpu.yaml` with `tp: 2` 1.08,
/// 1.20, 1.39 times as long with the default (min, median, max), peak memory 234 against 237
/// MiB; `specs/llama-tiny.yaml` 1.05 (median of 4); 1F1B and `gpt-tiny` within their spread
/// (Xeon, 2026-12-07).
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one option of the allocator this binary links; passes no pointer
        #[allow(unsafe_code)]
        unsafe {
            allocator::mi_option_set(MI_OPTION_PURGE_DELAY, -1)
        }
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Check { files, format } => check_cmd::run(&files, format, std::io::stderr().is_terminal()),
        Command::Explain { code, list } => explain(code.as_deref(), list),
        Command::Emit { input, engine, out } => emit_cmd::run(&input, engine, &out),
        Command::Export { checkpoint, out, plan } => export_cmd::run(&checkpoint, &out, plan.as_deref()),
        Command::Import { config, out, seq, name, engine, nodes, devices_per_node, device, gpus, model_config } => {
            import_cmd::run(import_cmd::ImportArgs {
                config: &config,
                out: out.as_deref(),
                seq,
                name: name.as_deref(),
                target: pipec_grammar::import::hf::Target {
                    engine: engine.map(|e| e.spec_value().to_string()),
                    nodes: nodes as usize,
                    devices_per_node: devices_per_node as usize,
                    device,
                },
                gpus,
                model_config: model_config.as_deref(),
            })
        }
        Command::Search { file, profile, allow_async, max_depth, headroom, schedules, top, exact_top, format } => {
            search_cmd::run(search_cmd::SearchArgs {
                path: &file,
                profile: profile.as_deref(),
                allow_async,
                max_depth,
                headroom_percent: headroom,
                schedules: &schedules,
                top,
                exact_top,
                format,
            })
        }
        Command::Compare { file, profile, microbatches, format } => {
            compare_cmd::run(&file, profile.as_deref(), &microbatches, format)
        }
        Command::Compile { file, out, emit, profile, format, resume } => compile_cmd::run(
            &file,
            out,
            emit,
            format,
            std::io::stderr().is_terminal(),
            profile.as_deref(),
            resume.as_deref(),
        ),
        Command::Run(args) => run_cmd::run(args),
        Command::Launch {
            file,
            hostfile,
            out,
            exec,
            timeout,
            start_timeout,
            elastic,
            min_devices,
            max_restarts,
            slurm,
        } => launch_cmd::run(launch_cmd::LaunchArgs {
            file: &file,
            hostfile: hostfile.as_deref(),
            out: out.as_deref(),
            exec,
            timeout,
            start_timeout: std::time::Duration::from_secs(start_timeout.max(1)),
            elastic: elastic.then_some(launch_cmd::Elastic { min_devices, max_restarts }),
            slurm,
        }),
        Command::Calibrate { out, measured: Some(spec), step, log, .. } => {
            calibrate_measured::run(&spec, step.as_deref(), log.as_deref(), out)
        }
        Command::Calibrate { out, measured: None, backend, memory, reps, concurrent, .. } => calibrate_cmd::run(
            out.unwrap_or_else(|| PathBuf::from("device.json")),
            backend,
            &memory,
            reps,
            concurrent as usize,
        ),
        Command::Profile { file, out, backend, reps, concurrent } => {
            profile_cmd::run(&file, out, backend, reps, concurrent.map(|n| n as usize), std::io::stderr().is_terminal())
        }
        Command::Lsp => lsp::run(),
        Command::PlanProfile { file, nodes, devices_per_node, intra, inter, memory, batch, microbatches, sync } => {
            plan_profile_cmd::run(
                &file,
                &plan_profile_cmd::PlanProfileArgs {
                    nodes,
                    devices_per_node,
                    intra,
                    inter,
                    memory,
                    batch,
                    microbatches,
                    sync,
                },
            )
        }
        Command::Schema => {
            print!("{}", pipec_grammar::schema::json_schema_text());
            EXIT_OK
        }
    };
    ExitCode::from(code)
}

fn explain(code: Option<&str>, list: bool) -> u8 {
    use pipec_grammar::codes::{lookup, CODES};
    if list || code.is_none() {
        for c in CODES {
            println!("{}  {}", c.code, c.title);
        }
        return EXIT_OK;
    }
    let code = code.unwrap_or_default();
    match lookup(code) {
        Some(c) => {
            println!("{}: {}\n\n{}", c.code, c.title, c.explanation);
            EXIT_OK
        }
        None => {
            eprintln!("error: `{code}` is not a pipec diagnostic code (`pipec explain --list` lists them)");
            EXIT_USAGE
        }
    }
}

/// An engine's name (`--engine`), spelled as in a spec's `engine:`.
fn parse_engine(text: &str) -> Result<pipec_plan::vocab::Engine, String> {
    use pipec_plan::vocab::Choice;
    pipec_plan::vocab::Engine::ALL
        .iter()
        .copied()
        .find(|e| e.name() == text)
        .ok_or_else(|| format!("`{text}` is not an engine: {}", pipec_plan::engine::engine_names().join(", ")))
}

#[cfg(test)]
mod allocator_tests {
    /// The option's index names mimalloc's purge delay (its default in this build, 1,000 ms,
    /// read before pipec sets it), and pipec sets it to -1.
    #[test]
    fn the_allocator_keeps_freed_memory() {
        #[allow(unsafe_code)]
        // SAFETY: reads one option of the allocator this binary links
        let delay = || unsafe { super::allocator::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        assert_eq!(delay(), 1000, "mimalloc's default purge delay");
        super::keep_freed_memory();
        assert_eq!(delay(), -1);
    }
}
