//! `engine:`: the engine a spec names reaches the plan.

use pipec_compiler::{compile, CompileOptions};
use pipec_plan::engine::EngineTarget;
use pipec_plan::vocab::Engine;
use pipec_plan::Plan;

/// A small GPT every engine runs: two blocks on two stages under 1F1B.
const GPT: &str = "name: engines-gpt
model:
  input: [32]
  layers:
    - embedding(64, 32)
    - repeat 2: transformer_block(d=32, heads=4, ff=64, causal=true)
    - layernorm
    - linear(32, 64)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 2
  device: { kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }
  links:
    intra_node: { bandwidth: 10GB/s, latency: 5us }
strategy:
  stages: straight
  schedule: 1f1b
  microbatches: 4
training:
  batch_size: 32
  steps: 3
  optimizer: { kind: adam, lr: 0.001 }
";

fn plan_of(text: &str) -> Plan {
    let checked = pipec_grammar::check_source(text);
    let spec = checked.spec.unwrap_or_else(|| panic!("the spec checks: {:?}", checked.diagnostics));
    compile(&spec, &CompileOptions::default()).into_compiled().expect("compiles").plan
}

#[test]
fn the_plan_records_the_engine_and_release_the_spec_names() {
    let plan = plan_of(&format!("engine: {{ name: megatron, version: \"0.19\" }}\n{GPT}"));
    assert_eq!(plan.engine, EngineTarget { name: Engine::Megatron, version: "0.19.2".into() });
    let json = serde_json::to_string(&plan).expect("serialises");
    assert!(json.contains(r#""engine":{"name":"megatron","version":"0.19.2"}"#), "{}", &json[..200]);
    assert_eq!(Plan::from_json(&json).expect("reads back").engine, plan.engine);
    let named = plan_of(&format!("engine: deepspeed\n{GPT}"));
    assert_eq!(named.engine, EngineTarget::newest(Engine::Deepspeed));
}

#[test]
fn a_plan_without_an_engine_is_pipecs_and_an_unknown_release_is_refused() {
    let plan = plan_of(GPT);
    assert!(plan.engine.is_pipec());
    let json = serde_json::to_string(&plan).expect("serialises");
    assert!(!json.contains("\"engine\""), "pipec, the default, is not written");
    assert!(Plan::from_json(&json).expect("reads").engine.is_pipec());
    let mut edited = plan.clone();
    edited.engine = EngineTarget { name: Engine::Megatron, version: "0.17.0".into() };
    let problems = edited.check();
    assert!(problems.iter().any(|p| p.contains("engine: pipec describes megatron 0.19.0 to 0.19.2")), "{problems:?}");
    let unknown =
        json.replacen("{\"version\":", "{\"engine\":{\"name\":\"jax\",\"version\":\"1.0.0\"},\"version\":", 1);
    assert!(Plan::from_json(&unknown).is_err_and(|e| e.contains("jax")));
}
