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
    assert_eq!(memory_errors.len(), 16, "Figure 1's 16 figures");
    let mean = step_errors.iter().map(|(_, e)| e.abs()).sum::<f64>() / step_errors.len() as f64;
    let worst = step_errors.iter().map(|(_, e)| e.abs()).fold(0.0, f64::max);
    assert!(mean <= 0.03 && worst <= 0.08, "iteration times: mean {mean:.4}, worst {worst:.4}: {step_errors:#?}");
    for (what, e) in &memory_errors {
        assert!(e.abs() <= 0.03, "{what}: {:+.2}%", e * 100.0);
    }
}
