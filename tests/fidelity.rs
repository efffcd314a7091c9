//! The cost and memory model against published runs (bench/specs/published/published.csv):
//! Korthikanti et al. 2022's Table 5 iteration times and Figure 1 memory per GPU, and
//! Narayanan et al. 2021's Table 1 (by its FLOP count), each row's spec naming the paper's
//! layout on the A100 80 GB preset and the DGX A100 links. Bounds: iteration times within
//! 3% on average and 8% at worst; memory figures within 3% each.

use std::path::Path;

use pipec_compiler::fidelity::{predict_source, read_published, relative_error};

fn folder() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/published")
}

#[test]
fn published_iteration_times_and_memory_are_predicted_within_bounds() {
    let table = std::fs::read_to_string(folder().join("published.csv")).expect("the table");
    let rows = read_published(&table).expect("reads");
    let (mut step_errors, mut memory_errors) = (Vec::new(), Vec::new());
    for row in &rows {
        let source = std::fs::read_to_string(folder().join(&row.spec)).expect("the row's spec");
        let p = predict_source(&source, Some(&folder())).unwrap_or_else(|e| panic!("{}: {e}", row.spec));
        if let Some(step) = row.step_s {
            assert!(p.fits, "{}: a published run must fit its devices", row.spec);
            step_errors.push((row.spec.clone(), relative_error(p.step_s, step)));
        }
        if let Some(state) = row.model_state_gib {
            memory_errors
                .push((format!("{} weights+gradients+optimizer", row.spec), relative_error(p.model_state_gib, state)));
        }
        if let Some(act) = row.activations_gib {
            memory_errors.push((format!("{} activations", row.spec), relative_error(p.activations_gib, act)));
        }
    }
    assert_eq!(step_errors.len(), 18, "Table 5's 8 rows and Table 1's 10");
    assert_eq!(memory_errors.len(), 15, "Figure 1's 16 figures but the 22B blocks' sequence-parallel activations");
    let mean = step_errors.iter().map(|(_, e)| e.abs()).sum::<f64>() / step_errors.len() as f64;
    let worst = step_errors.iter().map(|(_, e)| e.abs()).fold(0.0, f64::max);
    assert!(mean <= 0.03 && worst <= 0.08, "iteration times: mean {mean:.4}, worst {worst:.4}: {step_errors:#?}");
    for (what, e) in &memory_errors {
        assert!(e.abs() <= 0.03, "{what}: {:+.2}%", e * 100.0);
    }
}

/// A published peak with its unit, `71.9 GiB` or `58.8 GB` (10⁹ bytes), in GiB.
fn gib(cell: &str) -> f64 {
    let (value, unit) = cell.split_once(' ').unwrap_or_else(|| panic!("`{cell}`: a figure and its unit"));
    let value: f64 = value.parse().unwrap_or_else(|_| panic!("`{cell}`: a figure"));
    match unit {
        "GiB" => value,
        "GB" => value * 1e9 / (1u64 << 30) as f64,
        other => panic!("`{other}`: GiB or GB"),
    }
}

/// One row of bench/specs/published-2025/runs.csv.
struct Run {
    spec: String,
    moe: bool,
    fp8: bool,
    /// The published peak, in GiB (a figure in decimal GB converted).
    peak_gib: Option<f64>,
    fits: bool,
    memory_held: Option<bool>,
}

fn read_runs(text: &str) -> Vec<Run> {
    let mut lines = text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty());
    assert_eq!(lines.next(), Some("spec,run,moe,fp8,peak,fit,memory"), "the table's header");
    let flag = |v: &str| match v {
        "yes" => true,
        "no" | "open" => false,
        other => panic!("`{other}`: yes, no or open"),
    };
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), 7, "{l}");
            Run {
                spec: cells[0].to_string(),
                moe: flag(cells[2]),
                fp8: flag(cells[3]),
                peak_gib: (!cells[4].is_empty()).then(|| gib(cells[4])),
                fits: flag(cells[5]),
                memory_held: match cells[6] {
                    "" => None,
                    "held" => Some(true),
                    "open" => Some(false),
                    other => panic!("`{other}`: held or open"),
                },
            }
        })
        .collect()
}

/// Published 2025-26 runs (bench/specs/published-2025/runs.csv), each at its published
/// layout: the table says which pipec compiles without E0601 and whose predicted peak is
/// within +10% / -5% of the published one; the test holds the table to what pipec predicts,
/// so a gap closed or opened shows here.
#[test]
fn published_2025_runs_fit_and_their_peaks_are_as_the_table_says() {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/published-2025");
    let runs = read_runs(&std::fs::read_to_string(folder.join("runs.csv")).expect("the table"));
    assert!(runs.len() >= 15, "{} runs", runs.len());
    assert!(runs.iter().filter(|r| r.moe).count() >= 5, "at least 5 mixtures of experts");
    assert!(runs.iter().filter(|r| r.fp8).count() >= 5, "at least 5 FP8 runs");
    let mut wrong = Vec::new();
    for run in &runs {
        let source = std::fs::read_to_string(folder.join(&run.spec)).expect("the run's spec");
        let p = predict_source(&source, Some(&folder)).unwrap_or_else(|e| panic!("{}: {e}", run.spec));
        if p.fits != run.fits {
            wrong.push(format!(
                "{}: fits {} (peak {:.2} GiB), the table says {}",
                run.spec, p.fits, p.peak_gib, run.fits
            ));
        }
        if let (Some(published), Some(held)) = (run.peak_gib, run.memory_held) {
            let e = relative_error(p.peak_gib, published);
            if ((-0.05..=0.10).contains(&e)) != held {
                wrong.push(format!(
                    "{}: predicted {:.2} GiB against {published} GiB ({:+.1}%), the table says {}",
                    run.spec,
                    p.peak_gib,
                    e * 100.0,
                    if held { "held" } else { "open" }
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // issue #65's bar: every published layout compiles without E0601
    let rejected: Vec<&str> = runs.iter().filter(|r| !r.fits).map(|r| r.spec.as_str()).collect();
    assert!(rejected.is_empty(), "published layouts pipec rejects: {rejected:?}");
}

/// Published 2025–26 step times (bench/specs/published-2025/steps.csv), split before any
/// fitting into a calibration half and a held-out half. Every engine × device kind's one
/// constant (`pipec_plan::engine::performance::CALIBRATED`) must be what its calibration
/// rows give (refitted here), and the held-out rows, predicted with those constants, must
/// stay within the bounds below (docs/benchmarks.md, "Step times", shows both halves).
#[test]
fn published_2025_step_times_are_predicted_within_bounds_on_the_held_out_half() {
    use pipec_compiler::fidelity::{read_steps, refit_all, Half, StepSpec};
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/published-2025");
    let rows = read_steps(&std::fs::read_to_string(folder.join("steps.csv")).expect("the table")).expect("reads");
    assert!(rows.len() >= 15, "at least 15 published runs");
    assert!(rows.iter().filter(|r| r.moe).count() >= 5 && rows.iter().filter(|r| r.fp8).count() >= 5);
    let specs: Vec<StepSpec> = rows
        .iter()
        .map(|r| {
            let source = std::fs::read_to_string(folder.join(&r.spec)).expect("the row's spec");
            StepSpec::check(&source, Some(&folder)).unwrap_or_else(|e| panic!("{}: {e}", r.spec))
        })
        .collect();
    for r in refit_all(&rows, &specs) {
        let kind = &r.kind;
        assert!(!r.calibration.is_empty(), "{kind:?}: no calibration row");
        assert!(!r.held_out.is_empty(), "{kind:?}: no held-out row");
        assert!(r.table.calibrated, "{kind:?}: no fitted constant: {}", r.table.source);
        // the experts' constant is fitted on the kind's MoE rows where it also has dense ones
        let experts_fitted = r.fitted_experts.is_some();
        let experts_source = r.table.experts_source.clone().unwrap_or_default();
        for &i in &r.calibration {
            let named = rows[i].spec.trim_end_matches(".yaml");
            let source = if rows[i].moe && rows[i].fp8 && experts_fitted { &experts_source } else { &r.table.source };
            assert!(source.contains(named), "{kind:?}: the constant fitted on {named} does not name it: {source}");
        }
        for &i in &r.held_out {
            let named = rows[i].spec.trim_end_matches(".yaml");
            assert!(
                !r.table.source.contains(named) && !experts_source.contains(named),
                "{kind:?}: held-out {named} named as a calibration row"
            );
        }
        let fitted = r.fitted.clone().expect("fits");
        assert!(
            (fitted / r.table.efficiency - 1.0).abs() < 0.005,
            "{kind:?}: the table's constant {} is not what its calibration rows give ({fitted:.4})",
            r.table.efficiency
        );
        let experts = r.fitted_experts.clone().map_or(Ok(1.0), |f| f).expect("the experts' constant fits");
        assert!(
            (experts / r.table.experts - 1.0).abs() < 0.005,
            "{kind:?}: the table's experts' constant {} is not what its calibration rows give ({experts:.4})",
            r.table.experts
        );
        assert_eq!(experts_fitted, r.table.experts_source.is_some(), "{kind:?}: an experts' constant without its rows");
    }
    let held: Vec<(String, f64)> = rows
        .iter()
        .zip(&specs)
        .filter(|(r, _)| r.half == Half::HeldOut)
        .map(|(r, s)| (r.spec.clone(), s.step(None).expect("predicts") / r.step_s - 1.0))
        .collect();
    let mean = held.iter().map(|(_, e)| e.abs()).sum::<f64>() / held.len() as f64;
    let worst = held.iter().map(|(_, e)| e.abs()).fold(0.0, f64::max);
    assert!(
        mean <= HELD_OUT_MEAN && worst <= HELD_OUT_WORST,
        "held-out step times: mean {mean:.4}, worst {worst:.4}: {held:#?}"
    );
}

/// The held-out half's bounds, at what the model reaches today (docs/benchmarks.md, "Step
/// times": 10.0% and 47.9% over 23 rows on 2026-12-07, the worst the 25.11 container's
/// Qwen3-30B-A3B row, which ran the layout that the 25.09 container ran at twice its speed);
/// the target is 5% mean and 12% worst.
const HELD_OUT_MEAN: f64 = 0.11;
const HELD_OUT_WORST: f64 = 0.49;

/// A published spec's dispatch, expert-parallel overlap and gradient precision are the ones
/// its header says the run's recipe used: a header line `# Dispatch: … (`moe_dispatch:
/// deepep`)` (DeepEP or HybridEP, Megatron-LM's flex dispatcher) comes with `moe_dispatch:
/// deepep` in the strategy, a line `# Expert-parallel overlap: … `ep_overlap: true`` with
/// `ep_overlap: true`, a line `# Gradients: … `grad_precision: bf16`` with `grad_precision:
/// bf16`, a line `# Weights: … `master_weights: false`` with `master_weights: false`, and a
/// spec written with any of them has its line — so a row cannot be priced on an exchange, an
/// overlap, a gradient size or a model state its source does not name.
#[test]
fn published_2025_specs_dispatch_as_their_headers_say() {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/published-2025");
    let mut wrong = Vec::new();
    let (mut flex, mut overlapped, mut in_bf16) = (0, 0, 0);
    for entry in std::fs::read_dir(&folder).expect("the folder") {
        let path = entry.expect("an entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("the spec");
        let header = text
            .lines()
            .filter(|l| l.starts_with("# Dispatch:"))
            .any(|l| (l.contains("DeepEP") || l.contains("HybridEP")) && l.contains("`moe_dispatch: deepep`"));
        let written = text.lines().any(|l| l.trim() == "moe_dispatch: deepep");
        flex += usize::from(written);
        if header != written {
            wrong.push(format!("{}: header says flex dispatch {header}, strategy {written}", path.display()));
        }
        // the gradient precision its recipe set
        let bf16 = text.lines().any(|l| l.starts_with("# Gradients:") && l.contains("`grad_precision: bf16`"));
        let reduced = text.lines().any(|l| l.trim() == "grad_precision: bf16");
        in_bf16 += usize::from(reduced);
        if bf16 != reduced {
            wrong.push(format!("{}: header says bf16 gradients {bf16}, training {reduced}", path.display()));
        }
        // the weights without an fp32 master its recipe built
        let masterless = text.lines().any(|l| l.starts_with("# Weights:") && l.contains("`master_weights: false`"));
        let written_masterless = text.lines().any(|l| !l.starts_with('#') && l.contains("master_weights: false"));
        if masterless != written_masterless {
            wrong.push(format!(
                "{}: header says weights without a master {masterless}, training {written_masterless}",
                path.display()
            ));
        }
        // and the expert-parallel overlap its recipe or study turned on
        let said =
            text.lines().any(|l| l.starts_with("# Expert-parallel overlap:") && l.contains("`ep_overlap: true`"));
        let on = text.lines().any(|l| l.trim() == "ep_overlap: true");
        overlapped += usize::from(on);
        if said != on {
            wrong.push(format!("{}: header says expert-parallel overlap {said}, strategy {on}", path.display()));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // the canonical study's two runs and the three Megatron-Bridge tables' Qwen3-30B-A3B
    // rows at v0.3.0, v0.4.0 and v0.5.0
    assert!(flex >= 5, "{flex} specs dispatch with DeepEP or HybridEP");
    // the canonical study run and the recipes at v0.2.0 and v0.3.0 (`moe_a2a_overlap`)
    assert!(overlapped >= 3, "{overlapped} specs overlap expert-parallel all-to-alls");
    // Megatron-Bridge's performance recipes reduce gradients in bf16 (`grad_reduce_in_fp32 =
    // False`): its eight table and study rows whose recipe file says so
    assert!(in_bf16 >= 8, "{in_bf16} specs keep bf16 gradients");
}
