//! `pipec compile`: spec → plan, with the plan's files written atomically.

use std::path::{Path, PathBuf};

use pipec_compiler::lower::compute_order;
use pipec_compiler::memory::table;
use pipec_compiler::render::{human_time, memory_svg, timeline_svg, trace_json};
use pipec_compiler::{compile, CompileOptions, Compiled};
use pipec_grammar::diagnostic::{render_human, render_json, Diagnostic};

use crate::check_cmd::read_spec;
use crate::output::write_atomic;
use crate::{Format, EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// What `--emit` prints on standard output.
#[derive(Clone, Copy, Debug, clap::ValueEnum, PartialEq, Eq)]
pub enum Emit {
    /// The IR dump.
    Ir,
    /// The instruction streams in text form.
    Streams,
    /// plan.json.
    Plan,
    /// The per-device memory table.
    Memory,
    /// The compute order as torch.distributed.pipelining CSV (one row per rank).
    TorchCsv,
}

/// The outcome of compiling a spec file: the compiled plan, or the exit code already earned.
pub fn compile_file(
    path: &Path,
    format: Format,
    color: bool,
    profile: Option<&Path>,
) -> Result<(Compiled, String), u8> {
    compile_file_with(path, format, color, profile, &mut |_| {})
}

/// [`compile_file`], the checked spec first changed by `adjust` (`pipec run` puts this
/// machine's CPU in place of a device written inline).
pub fn compile_file_with(
    path: &Path,
    format: Format,
    color: bool,
    profile: Option<&Path>,
    adjust: &mut dyn FnMut(&mut pipec_grammar::spec::Spec),
) -> Result<(Compiled, String), u8> {
    let source = read_spec(path).map_err(|e| {
        eprintln!("error: {e}");
        EXIT_USAGE
    })?;
    let name = path.display().to_string();
    let report = |diags: &[Diagnostic]| match format {
        Format::Human => eprint!("{}", render_human(&name, &source, diags, color)),
        Format::Json => print!("{}", render_json(&name, &source, diags)),
    };
    let checked = pipec_grammar::check_source_in(
        &source,
        Some(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))),
    );
    if !checked.diagnostics.is_empty() {
        report(&checked.diagnostics);
    }
    let Some(mut spec) = checked.spec else {
        if format == Format::Human {
            eprintln!("{name}: not compiled: {} error(s)", checked.diagnostics.iter().filter(|d| d.is_error()).count());
        }
        return Err(EXIT_DIAGNOSTICS);
    };
    adjust(&mut spec);
    write_token_cache(&spec, path)?;
    let profile = profile.map(read_profile).transpose()?;
    let options = CompileOptions {
        profile,
        base_dir: path.parent().map(Path::to_path_buf),
        source: Some(source.as_str().into()),
    };
    let result = compile(&spec, &options);
    if !result.diagnostics.is_empty() {
        report(&result.diagnostics);
    }
    match result.compiled {
        None => Err(EXIT_DIAGNOSTICS),
        Some(_) if result.has_errors() => {
            if format == Format::Human {
                eprintln!("{name}: the plan is infeasible; nothing written");
            }
            Err(EXIT_DIAGNOSTICS)
        }
        Some(compiled) => Ok((compiled, source)),
    }
}

/// JSON Lines data trains from its token cache (`pipec_plan::datafile::token_cache`): read
/// whole and written before the plan that names it, unless it is there already.
fn write_token_cache(spec: &pipec_grammar::spec::Spec, path: &Path) -> Result<(), u8> {
    let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let (Some(records), Some(vocab)) = (spec.training.data.records(base), spec.model.token_vocab()) else {
        return Ok(());
    };
    match pipec_plan::datafile::write_token_cache(&records, vocab) {
        Ok((cache, Some(tokens))) => {
            eprintln!("note: tokenized `{}` into {} ({tokens} tokens)", records.path.display(), cache.display());
            Ok(())
        }
        Ok((_, None)) => Ok(()),
        Err(e) => {
            eprintln!("error: {e}");
            Err(EXIT_USAGE)
        }
    }
}

/// Reads a profile written by `pipec profile`; on failure the error is printed and the exit
/// code returned.
pub fn read_profile(p: &Path) -> Result<pipec_plan::profile::Profile, u8> {
    let text = crate::check_cmd::read_text(p, crate::check_cmd::MAX_PLAN_BYTES, true).map_err(|e| {
        eprintln!("error: profile: {e}");
        EXIT_USAGE
    })?;
    let profile: pipec_plan::profile::Profile = serde_json::from_str(&text).map_err(|e| {
        eprintln!("error: `{}` is not a pipec profile: {e}", p.display());
        EXIT_USAGE
    })?;
    profile.check().map_err(|e| {
        eprintln!("error: `{}`: {e}", p.display());
        EXIT_USAGE
    })?;
    Ok(profile)
}

pub fn run(
    path: &Path,
    out: Option<PathBuf>,
    emit: Option<Emit>,
    format: Format,
    color: bool,
    profile: Option<&Path>,
    resume: Option<&Path>,
) -> u8 {
    let (compiled, _) = match compile_file(path, format, color, profile) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let plan = &compiled.plan;
    let moves = match resume.map(|r| resume_moves(r, plan)).transpose() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let dir =
        out.unwrap_or_else(|| PathBuf::from("out").join(path.file_stem().and_then(|s| s.to_str()).unwrap_or("plan")));
    let plan_json = match pipec_plan::output::json_text(plan) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: cannot serialise the plan: {e}");
            return EXIT_USAGE;
        }
    };
    let files: [(&str, String); 4] = [
        ("plan.json", plan_json),
        ("timeline.svg", timeline_svg(plan, &compiled.timeline)),
        ("memory.svg", memory_svg(plan)),
        ("trace.json", trace_json(plan, &compiled.timeline)),
    ];
    for (file, contents) in &files {
        if let Err(e) = write_atomic(&dir.join(file), contents.as_bytes()) {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    }
    match emit {
        Some(Emit::Ir) => print!("{}", compiled.graph),
        Some(Emit::Streams) => print!("{}", plan.streams_text()),
        Some(Emit::Plan) => print!("{}", files[0].1),
        Some(Emit::Memory) => print!("{}", memory_table(plan)),
        Some(Emit::TorchCsv) => print!("{}", torch_csv(plan)),
        None => {}
    }
    // the report on standard output, unless `--emit` put the emitted form there
    let report = |text: &str| if emit.is_some() { eprint!("{text}") } else { print!("{text}") };
    if format == Format::Human {
        report(&summary(plan, &dir));
    }
    if let Some(text) = moves {
        report(&text);
    }
    EXIT_OK
}

/// What resuming `plan` from the checkpoint at `resume` moves between devices, in words.
fn resume_moves(resume: &Path, plan: &pipec_plan::Plan) -> Result<String, String> {
    use pipec_plan::checkpoint;
    let dir = checkpoint::locate_in(resume, plan.training.checkpoint_dir.as_deref())?;
    let loaded = checkpoint::read(&dir).map_err(|e| format!("checkpoint: {e}"))?;
    loaded.check_fits(plan).map_err(|e| format!("checkpoint: {e}"))?;
    let saved = loaded.identity.ok_or("checkpoint: written by an older pipec, it does not say how it was laid out")?;
    let moves = checkpoint::reshard(&saved, plan).map_err(|e| format!("checkpoint: {e}"))?;
    let devices = |d: &[u32]| d.iter().map(|d| format!("d{d}")).collect::<Vec<_>>().join(",");
    let total: u64 = moves.iter().map(|m| m.bytes).sum();
    let mut s = format!(
        "resume from {} (step {}, layout `{}`) onto `{}`: {} to move\n",
        dir.display(),
        loaded.completed_steps,
        saved.partition,
        plan.partition,
        pipec_compiler::memory::human_bytes(total)
    );
    for m in &moves {
        let what = if m.bytes == 0 {
            "stays".to_string()
        } else {
            format!("{} to move", pipec_compiler::memory::human_bytes(m.bytes))
        };
        s.push_str(&format!(
            "  layers [{}, {}): {} -> {}  {what}\n",
            m.layers[0],
            m.layers[1],
            devices(&m.from),
            devices(&m.to)
        ));
    }
    Ok(s)
}

fn memory_table(plan: &pipec_plan::Plan) -> String {
    let rows = device_rows(plan);
    let with_memory: Vec<_> =
        rows.iter().zip(&plan.devices).map(|((id, st, r), d)| (*id, st.clone(), *r, &d.memory)).collect();
    table(&with_memory)
}

/// Member 0's and member 1's positions, as ranges (`0..4 and 28..32 (member 0), …`).
fn context_chunks(seq: usize, cp: usize) -> String {
    let chunk = seq / (2 * cp).max(1);
    let member = |c: usize| {
        let late = 2 * cp - 1 - c;
        format!("{}..{} and {}..{}", c * chunk, (c + 1) * chunk, late * chunk, (late + 1) * chunk)
    };
    format!("{} (c = 0), {} (c = 1), …", member(0), member(1))
}

fn summary(plan: &pipec_plan::Plan, dir: &Path) -> String {
    let sim = &plan.simulation;
    let headroom = plan.memory_headroom();
    let mut s = String::new();
    // context parallelism counts each microbatch's chunks as microbatches of their own
    let cp = plan.training.context_parallel.max(1);
    let chunks =
        if cp > 1 { format!(" ({} chunk-microbatches of cp {cp})", plan.training.microbatches) } else { String::new() };
    s.push_str(&format!(
        "{}: {} schedule, layout {} ({} stage(s) on {} device(s)), {} microbatches of {}{chunks}\n",
        plan.name,
        plan.schedule.kind,
        plan.partition,
        plan.stages.len(),
        plan.devices.len(),
        plan.training.microbatches / cp,
        plan.training.microbatch_size
    ));
    // the tie is mentioned only for a model that has one
    let tied = if plan.layers.iter().any(|l| l.tied.is_some()) {
        " (a weight tied to an embedding counted once; a stage's figure counts the copy it holds)"
    } else {
        ""
    };
    let mtp = plan.model.mtp.map(|m| m.parameters_text(plan.layers.iter().map(|l| &l.op))).unwrap_or_default();
    s.push_str(&format!(
        "  model: {}{mtp}{tied}\n",
        pipec_plan::model::parameters_text(plan.layers.iter().map(|l| (&l.op, l.tied)))
    ));
    // recompute inside the blocks: what the plan's engine runs again in each backward
    if let Some(b) = &plan.schedule.block_recompute {
        let runs = match plan.engine.name {
            pipec_plan::Engine::Pipec => format!("pipec's executor runs again in each backward {}", b.executor_words()),
            other => format!("counted as {} runs it", other.name()),
        };
        s.push_str(&format!("  recompute inside the blocks `{}`: {runs}\n", b.text()));
    }
    let cp = plan.training.context_parallel;
    if cp > 1 {
        let seq = plan.model.input.first().copied().unwrap_or(0);
        let (f, b) = plan.stages.iter().fold((0.0, 0.0), |(f, b), st| (f + st.context_s[0], b + st.context_s[1]));
        let exchange = match plan.schedule.cp_comm {
            pipec_plan::vocab::CpComm::AllGather => format!(
                "keys and values gathered in every forward ({:.1} µs per microbatch over the stages), their gradients sent back in every backward ({:.1} µs)",
                f * 1e6,
                b * 1e6
            ),
            pipec_plan::vocab::CpComm::Ring => format!(
                "keys and values passed around the ring under the attention in every forward ({:.1} µs per microbatch over the stages not covered), around again with their gradients in every backward ({:.1} µs not covered)",
                f * 1e6,
                b * 1e6
            ),
        };
        s.push_str(&format!(
            "  context parallelism: cp {cp} — each of the {} microbatches is {cp} chunk-microbatches, member c of each group of {cp} replicas computing positions {} of every sequence of {seq}; {exchange}\n",
            plan.training.microbatches / cp,
            context_chunks(seq, cp),
        ));
    }
    // what the prediction assumes of a mixture of experts' routing
    if let Some(m) = plan.layers.iter().find_map(|l| l.op.moe()) {
        let capacity = if m.capacity > 0.0 {
            format!(", at most {}× its share under the capacity", m.capacity)
        } else {
            String::new()
        };
        let routing = if m.skew > 1.0 {
            format!(
                "skewed — the busiest of the {} experts takes {}× the mean share of the tokens' {} choices, the others the rest equally",
                m.experts, m.skew, m.top_k
            )
        } else {
            format!(
                "uniform — each of the {} experts takes 1/{} of the tokens' {} choices",
                m.experts, m.experts, m.top_k
            )
        };
        s.push_str(&format!("  mixture of experts: routing assumed {routing}{capacity}\n"));
        if let Some(st) = plan.stages.iter().find(|st| st.expert_parallel > 1) {
            let ep = st.expert_parallel as usize;
            // whole experts (`etp: 1`): the group is the replicas' tensor-parallel ranks, each
            // device its own experts; else each replica's experts split over its ranks (the
            // layout the engines are told)
            let layout = plan.engine_layout();
            let tp = layout.tp;
            let holds = if layout.etp == 1 && tp > 1 {
                format!("ep {} (experts whole: `etp: 1`) — each device holds {}", ep * tp, m.experts / (ep * tp))
            } else if tp > 1 {
                format!("ep {ep} — each replica holds {}, split over its {tp} tensor-parallel ranks,", m.experts / ep)
            } else {
                format!("ep {ep} — each device holds {}", m.experts / ep)
            };
            s.push_str(&format!(
                "  expert parallelism: {holds} of every block's {} experts, tokens reach them in all-to-alls inside every pass; an expert's gradient is summed over the {} replica(s) holding it\n",
                m.experts,
                st.replicas.len() / ep
            ));
        }
    }
    for st in &plan.stages {
        s.push_str(&format!(
            "  {}: layers {}..{} on {} ({} params), fwd {} bwd {} per microbatch{}\n",
            st.id,
            st.layers[0],
            st.layers[1],
            pipec_plan::instr::devices_text(&st.replicas),
            st.parameters,
            human_time(st.forward_s),
            human_time(st.backward_s),
            if st.recompute { ", forward recomputed before the backward" } else { "" }
        ));
        if !st.gradient_buckets.is_empty() {
            let sizes: Vec<String> =
                st.gradient_buckets.iter().map(|b| pipec_compiler::memory::human_bytes(b.bytes)).collect();
            // ZeRO-2 and 3 reduce-scatter every microbatch's gradients, ZeRO-1 the step's
            let (how, when) = match plan.schedule.sharding.level() {
                0 => ("reduced", "the last backward"),
                1 => ("reduce-scattered", "the last backward"),
                _ => ("reduce-scattered", "every backward"),
            };
            s.push_str(&format!(
                "    gradients {how} in {} buckets during {when} ({}, the last layers' first)\n",
                sizes.len(),
                sizes.join(", ")
            ));
        }
    }
    let kind = match sim.first_step_time_s {
        Some(first) => format!(
            "flush-free: steady-state step {} (the first, filling the pipeline: {})",
            human_time(sim.step_time_s),
            human_time(first)
        ),
        None => format!("predicted step {}", human_time(sim.step_time_s)),
    };
    s.push_str(&format!(
        "{kind}, bubble {:.1}%, {}; tightest memory headroom {:.1}%\n",
        sim.bubble_fraction * 100.0,
        plan.throughput_text(sim.throughput_samples_per_s),
        headroom * 100.0
    ));
    if let Some(tokens) = sim.tokens_per_s_per_device {
        let mfu = sim
            .mfu
            .as_ref()
            .map_or_else(|| "MFU not counted (a layer outside the engine's FLOP count)".to_string(), |m| m.text());
        s.push_str(&format!("per device: {tokens:.0} tokens/s, {mfu}\n"));
    }
    if let Some(p) = &plan.engine_performance {
        s.push_str(&p.text());
        s.push('\n');
    }
    // the device whose all-reduces are exposed the longest, if any device all-reduces
    if let Some(d) = sim.devices.iter().filter(|d| d.collective_s > 0.0).max_by(|a, b| {
        a.exposed_collective_s.total_cmp(&b.exposed_collective_s).then(a.collective_s.total_cmp(&b.collective_s))
    }) {
        let hidden = (d.collective_s - d.exposed_collective_s).max(0.0);
        // ZeRO-3's weight gathers are inside the passes, not collectives of their own
        let what = match plan.schedule.sharding {
            pipec_plan::vocab::Sharding::None => "all-reduce",
            pipec_plan::vocab::Sharding::Parameters => "gradient reduce-scatters",
            _ => "gradient reduce-scatters and weight all-gathers",
        };
        s.push_str(&format!(
            "{what} on {}: {} in flight per step, {} hidden behind compute, {} exposed ({:.1}% of the step)\n",
            d.id,
            human_time(d.collective_s),
            human_time(hidden),
            human_time(d.exposed_collective_s),
            if sim.step_time_s > 0.0 { d.exposed_collective_s / sim.step_time_s * 100.0 } else { 0.0 }
        ));
    }
    if let Some((d, a2a)) = all_to_all_per_step(plan).into_iter().max_by(|a, b| a.1.total_cmp(&b.1)) {
        let hidden = sim.devices.iter().find(|x| x.id == d).map_or(0.0, |x| x.overlapped_s);
        // pipec's executor runs a pair's two passes one after the other (`caveats`): the
        // prediction says so where the plan is for it
        let in_line = if plan.engine.name == pipec_plan::vocab::Engine::Pipec {
            " (priced as the engines that overlap them run them; pipec's executor runs them in line)"
        } else {
            ""
        };
        let hidden = if hidden > 0.0 {
            format!(", {} of it hidden by its overlapped pairs{in_line}", human_time(hidden))
        } else {
            String::new()
        };
        s.push_str(&format!(
            "all-to-all on {d}: {} per step inside its passes ({:.1}% of the step){hidden}\n",
            human_time(a2a),
            if sim.step_time_s > 0.0 { a2a / sim.step_time_s * 100.0 } else { 0.0 }
        ));
    }
    s.push_str(&memory_table(plan));
    s.push_str(&format!("wrote {}/{{plan.json, timeline.svg, memory.svg, trace.json}}\n", dir.display()));
    s
}

/// Expert parallelism: each device's seconds per step of the all-to-alls inside its passes
/// (the plan's per-stage figures over its stream's forwards, recomputes and backwards).
fn all_to_all_per_step(plan: &pipec_plan::Plan) -> Vec<(pipec_plan::DeviceId, f64)> {
    use pipec_plan::{Instr, Phase};
    plan.streams
        .iter()
        .map(|(d, stream)| {
            let t: f64 = stream
                .iter()
                .filter_map(|i: &Instr| {
                    let [f, b] = plan.stage(i.stage())?.all_to_all_s;
                    match i.phase() {
                        Phase::Forward | Phase::Recompute => Some(f),
                        Phase::Backward | Phase::BackwardInput => Some(b),
                        _ => None,
                    }
                })
                .sum();
            (*d, t)
        })
        .filter(|(_, t)| *t > 0.0)
        .collect()
}

/// The compute order per rank in torch.distributed.pipelining's CSV form (`0F0,0F1,...`,
/// I/W for the split backward), one row per device.
pub fn torch_csv(plan: &pipec_plan::Plan) -> String {
    let mut out = String::new();
    for stream in plan.streams.values() {
        let row: Vec<String> = compute_order(stream).iter().map(ToString::to_string).collect();
        out.push_str(&row.join(","));
        out.push('\n');
    }
    out
}

/// Per-device summary for the command line: (device, stages, replicas of its first stage).
fn device_rows(plan: &pipec_plan::Plan) -> Vec<(pipec_plan::DeviceId, Vec<pipec_plan::StageId>, usize)> {
    plan.devices
        .iter()
        .map(|d| {
            (
                d.id,
                d.stages.clone(),
                d.stages.first().and_then(|s| plan.stage(*s)).map(|s| s.replicas.len()).unwrap_or(0),
            )
        })
        .collect()
}
