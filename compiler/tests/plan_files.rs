//! Plans read back from `plan.json` after an edit: `verify_plan` never panics, whatever
//! number is changed, and any change to which stage, microbatch or peer an instruction
//! names is reported.

use pipec_compiler::verification::verify_plan;
use pipec_compiler::{compile, CompileOptions};
use pipec_plan::Plan;
use proptest::prelude::*;
use serde_json::Value;

fn plan_json(layout: &str, schedule: &str, devices: usize) -> Value {
    let text = format!(
        "model:\n  input: [32]\n  layers:\n    - repeat 4: linear(32, 32) -> relu\n    - linear(32, 4)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ memory: 1GiB, throughput: 1TFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 1us }}\nstrategy:\n  stages: {layout}\n  schedule: {schedule}\n  microbatches: 4\ntraining:\n  batch_size: 16\n  steps: 1\n  optimizer: {{ kind: adam, lr: 0.001 }}\n"
    );
    let spec = pipec_grammar::check_source(&text).spec.expect("valid spec");
    let plan = compile(&spec, &CompileOptions::default()).into_compiled().expect("compiles").plan;
    serde_json::to_value(&plan).expect("serialises")
}

fn plans() -> Vec<Value> {
    vec![
        plan_json("straight", "1f1b", 3),
        plan_json("\"2-1\"", "gpipe", 3),
        plan_json("straight", "chimera", 2),
        plan_json("\"1-1\"\n  tp: 2", "1f1b", 4),
    ]
}

/// Paths to every number in a JSON value.
fn numbers(v: &Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Number(_) => out.push(path.clone()),
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                path.push(i.to_string());
                numbers(x, path, out);
                path.pop();
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                path.push(k.clone());
                numbers(x, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[String]) -> &'a mut Value {
    path.iter().fold(v, |v, k| match v {
        Value::Array(a) => &mut a[k.parse::<usize>().expect("index")],
        other => &mut other[k.as_str()],
    })
}

#[test]
fn compiled_plans_verify_clean_after_a_round_trip() {
    for p in plans() {
        let plan = Plan::from_json(&p.to_string()).expect("reads back");
        assert_eq!(verify_plan(&plan), Vec::<String>::new());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]
    #[test]
    fn any_edited_number_is_handled(which in 0usize..4, pick in any::<prop::sample::Index>(), value in prop_oneof![Just(0u64), Just(1), Just(2), Just(3), Just(7), Just(1 << 31), Just(u64::from(u32::MAX)), Just(1 << 53)]) {
        let mut p = plans().swap_remove(which);
        let mut paths = Vec::new();
        numbers(&p, &mut Vec::new(), &mut paths);
        let path = pick.get(&paths).clone();
        let slot = at(&mut p, &path);
        let before = slot.clone();
        *slot = Value::from(value);
        let Ok(plan) = Plan::from_json(&p.to_string()) else { return Ok(()) };
        let problems = verify_plan(&plan);
        // what an instruction is about: changing it must be caught
        let field = path.last().map(String::as_str);
        if path.first().map(String::as_str) == Some("streams") && matches!(field, Some("stage" | "mb" | "peer")) && before != value {
            prop_assert!(!problems.is_empty(), "{path:?}: {before} → {value} was not caught");
        }
    }
}

#[test]
fn an_unknown_named_value_in_a_plan_file_is_a_load_error() {
    let plan = plan_json("\"2-1\"", "gpipe", 3);
    assert!(Plan::from_json(&plan.to_string()).is_ok());
    // each named choice, misspelled: refused with the value in the message, never a default
    let edits: [(&[&str], &str); 5] = [
        (&["schedule", "reduce"], "PS"),
        (&["schedule", "kind"], "one-f-one-b"),
        (&["training", "precision"], "fp64"),
        (&["training", "data", "task"], "ranking"),
        (&["model", "loss"], "hinge"),
    ];
    for (path, bad) in edits {
        let mut edited = plan.clone();
        let mut at = &mut edited;
        for key in path {
            at = &mut at[*key];
        }
        assert!(at.is_string(), "{path:?} is a named value");
        *at = Value::String(bad.to_string());
        let err = Plan::from_json(&edited.to_string()).expect_err("an unknown value is refused");
        assert!(err.contains("unknown variant") && err.contains(bad), "{path:?}: {err}");
    }
}
