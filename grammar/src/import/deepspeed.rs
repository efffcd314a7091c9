//! A DeepSpeed `ds_config.json` with the Hugging Face `config.json` of the model it trains
//! (DeepSpeed's configuration does not describe the model) as a spec. The batch follows
//! DeepSpeed's rule train_batch_size = micro · accumulation · data-parallel size
//! (deepspeed/runtime/config.py:590-652); the pipeline's depth is `pipeline.stages` and the
//! tensor-parallel degree `tensor_parallel.autotp_size`; the GPU count is given (`--gpus`).

use pipec_plan::vocab::{CpComm, Engine, Precision, ScheduleKind, Sharding};
use serde_json::Value;

use super::engine::{write_spec, RunFacts};

fn count(v: &Value, path: &[&str]) -> Result<Option<usize>, String> {
    let mut at = v;
    for key in path {
        match at.get(key) {
            Some(next) => at = next,
            None => return Ok(None),
        }
    }
    match at {
        Value::String(s) if s == "auto" => Ok(None),
        other => other
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("`{}`: {other} is not a whole number", path.join("."))),
    }
}

fn enabled(v: &Value, key: &str) -> bool {
    v.get(key).and_then(|b| b.get("enabled")).and_then(Value::as_bool).unwrap_or(false)
}

/// The model section of the spec `pipec import` writes for a Hugging Face config.
fn model_section(hf_config: &str, seq: Option<usize>) -> Result<String, String> {
    let spec = super::hf::import(hf_config, "model", seq, &super::hf::Target::default())
        .map_err(|e| format!("the model config: {e}"))?
        .spec;
    let start = spec.find("\nmodel:\n").ok_or("the model config's spec has no model")? + 1;
    let end = spec.find("\ncluster:\n").ok_or("the model config's spec has no cluster")? + 1;
    Ok(spec[start..end].to_string())
}

/// The spec a `ds_config.json` describes for the model of `hf_config` on `world` GPUs.
pub fn import(
    ds_config: &str,
    hf_config: &str,
    name: &str,
    world: Option<usize>,
    seq: Option<usize>,
) -> Result<String, String> {
    let c: Value = serde_json::from_str(ds_config).map_err(|e| format!("not JSON: {e}"))?;
    if !c.is_object() {
        return Err("not a JSON object".into());
    }
    let world = world.ok_or("a DeepSpeed config does not say how many GPUs it runs on: give --gpus")?;
    let pp = count(&c, &["pipeline", "stages"])?.unwrap_or(1).max(1);
    let tp = count(&c, &["tensor_parallel", "autotp_size"])?.unwrap_or(1).max(1);
    if !world.is_multiple_of(pp * tp) {
        return Err(format!("{world} GPUs are not a multiple of pipeline.stages·autotp_size = {}", pp * tp));
    }
    let dp = world / (pp * tp);
    let (tb, mb, gas) = (
        count(&c, &["train_batch_size"])?,
        count(&c, &["train_micro_batch_size_per_gpu"])?,
        count(&c, &["gradient_accumulation_steps"])?,
    );
    // config.py:607-652: the missing ones derived, integer division
    let (tb, mb, gas) = match (tb, mb, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => (t, m, t / m.max(1) / dp),
        (Some(t), None, Some(g)) => (t, t / dp / g.max(1), g),
        (None, Some(m), Some(g)) => (m * g * dp, m, g),
        (Some(t), None, None) => (t, t / dp, 1),
        (None, Some(m), None) => (m * dp, m, 1),
        _ => return Err("neither train_batch_size nor train_micro_batch_size_per_gpu is set".into()),
    };
    if tb == 0 || mb == 0 || gas == 0 || tb != mb * gas * dp {
        return Err(format!("train_batch_size {tb} ≠ micro {mb} · accumulation {gas} · data-parallel {dp} (DeepSpeed's own check, runtime/config.py:590-605)"));
    }
    let stage = count(&c, &["zero_optimization", "stage"])?.unwrap_or(0);
    let sharding =
        Sharding::of_level(stage as u64).ok_or_else(|| format!("zero_optimization.stage {stage} is not 0-3"))?;
    let precision = match (enabled(&c, "bf16"), enabled(&c, "fp16")) {
        (true, true) => {
            return Err("bf16 and fp16 are both enabled (DeepSpeed refuses it: runtime/config.py:511-512)".into())
        }
        (true, false) => Precision::Bf16,
        (false, true) => Precision::Fp16,
        (false, false) => Precision::Fp32,
    };
    let params = c.get("optimizer").and_then(|o| o.get("params")).cloned().unwrap_or(Value::Null);
    let f = |key: &str, default: f64| params.get(key).and_then(Value::as_f64).unwrap_or(default);
    let betas: Vec<f64> = params
        .get("betas")
        .and_then(Value::as_array)
        .map(|b| b.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    let kind = c.get("optimizer").and_then(|o| o.get("type")).and_then(Value::as_str).unwrap_or("AdamW").to_lowercase();
    let optimizer = if kind == "sgd" {
        ("sgd", [f("lr", 1e-3), f("momentum", 0.0), 0.0, 0.0, f("weight_decay", 0.0)])
    } else {
        (
            "adamw",
            [
                f("lr", 1e-3),
                betas.first().copied().unwrap_or(0.9),
                betas.get(1).copied().unwrap_or(0.999),
                f("eps", 1e-8),
                f("weight_decay", 0.01),
            ],
        )
    };
    let mut dropped = Vec::new();
    if c.get("zero_optimization").and_then(|z| z.get("offload_optimizer").or(z.get("offload_param"))).is_some() {
        dropped.push("ZeRO offload to the CPU or NVMe".into());
    }
    let dualpipev = c.get("pipeline").and_then(|p| p.get("schedule")).and_then(Value::as_str) == Some("DualPipeV");
    let run = RunFacts {
        compile: (false, false),
        world,
        tp,
        pp,
        cp: 1,
        ep: count(&c, &["expert_parallel", "autoep_size"])?.unwrap_or(1).max(1),
        // auto_ep_config.py:50: 1 unless written (auto_ep_folding.py:214-217 refuses others)
        etp: count(&c, &["expert_parallel", "expert_tensor_parallel_size"])?.unwrap_or(1).max(1),
        split_ends: (false, false),
        chunk_blocks: None,
        schedule: match (pp, dualpipev) {
            (1, _) => ScheduleKind::DpOnly,
            (_, true) => ScheduleKind::DualPipeV,
            _ => ScheduleKind::OneFOneB,
        },
        virtual_stages: if dualpipev { 2 } else { 1 },
        sharding,
        sequence_parallel: false,
        tp_overlap: c
            .get("tensor_parallel")
            .and_then(|t| t.get("tp_overlap_comm"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        cp_comm: CpComm::AllGather,
        moe_dispatch: pipec_plan::vocab::MoeDispatch::AllToAll,
        ep_overlap: false,
        recompute: if c.get("activation_checkpointing").is_some() { "true" } else { "false" }.into(),
        precision,
        fp8: None,
        grad_bf16: false,
        state_bf16: false,
        micro: mb,
        global: tb,
        steps: 1000,
        optimizer,
        clip: c.get("gradient_clipping").and_then(Value::as_f64),
        seed: 0,
    };
    write_spec(
        Engine::Deepspeed,
        "a DeepSpeed config with a Hugging Face model config",
        name,
        &model_section(hf_config, seq)?,
        &run,
        &dropped,
    )
}
