//! A torchtitan v0.2.2 TOML job configuration (`--job.config_file`) as a spec. The model is
//! a llama3 flavour resolved to its dimensions from torchtitan's own table
//! (`pipec_plan::engine::emit::LLAMA3_FLAVOURS`, torchtitan/models/llama3/__init__.py:29-100);
//! a key's default is v0.2.2's (torchtitan/config/job_config.py). The GPU count is not in the
//! file: it is given (`--gpus`).

use pipec_plan::engine::emit::{LLAMA3_FLAVOURS, LLAMA3_VOCAB};
use pipec_plan::model::{MlpKind, NormKind};
use pipec_plan::vocab::{Choice, CompileComponent, CpComm, Engine, Precision, ScheduleKind, Sharding};

use super::engine::{model_text, write_spec, ModelFacts, RunFacts};

/// Reads `[section] key` values with their v0.2.2 defaults.
struct Toml {
    table: toml::Table,
}

impl Toml {
    fn get(&self, section: &str, key: &str) -> Option<&toml::Value> {
        self.table.get(section)?.as_table()?.get(key)
    }
    fn int(&self, section: &str, key: &str, default: i64) -> Result<i64, String> {
        match self.get(section, key) {
            None => Ok(default),
            Some(v) => v.as_integer().ok_or_else(|| format!("`[{section}] {key} = {v}`: not a whole number")),
        }
    }
    fn float(&self, section: &str, key: &str, default: f64) -> Result<f64, String> {
        match self.get(section, key) {
            None => Ok(default),
            Some(v) => v
                .as_float()
                .or(v.as_integer().map(|i| i as f64))
                .ok_or_else(|| format!("`[{section}] {key} = {v}`: not a number")),
        }
    }
    fn text(&self, section: &str, key: &str, default: &str) -> Result<String, String> {
        match self.get(section, key) {
            None => Ok(default.to_string()),
            Some(v) => v.as_str().map(str::to_string).ok_or_else(|| format!("`[{section}] {key} = {v}`: not a string")),
        }
    }
    fn flag(&self, section: &str, key: &str) -> bool {
        self.get(section, key).and_then(toml::Value::as_bool).unwrap_or(false)
    }
}

fn positive(v: i64, what: &str) -> Result<usize, String> {
    usize::try_from(v).ok().filter(|n| *n > 0).ok_or_else(|| format!("`{what} = {v}` must be at least 1"))
}

/// The spec a torchtitan v0.2.2 job configuration describes on `world` GPUs.
pub fn import(text: &str, name: &str, world: Option<usize>) -> Result<String, String> {
    let table: toml::Table = text.parse().map_err(|e| format!("not TOML: {e}"))?;
    let t = Toml { table };
    let world = world.ok_or("a torchtitan configuration does not say how many GPUs it runs on: give --gpus")?;
    let model_name = t.text("model", "name", "llama3")?;
    let flavour = t.text("model", "flavor", "debugmodel")?;
    let Some((_, [d, layers, heads, kv, ff], rope)) =
        LLAMA3_FLAVOURS.iter().find(|(f, _, _)| *f == flavour).filter(|_| model_name == "llama3")
    else {
        let known: Vec<&str> = LLAMA3_FLAVOURS.iter().map(|(f, _, _)| *f).collect();
        return Err(format!(
            "model `{model_name}` flavour `{flavour}` is not one pipec knows the dimensions of (llama3: {})",
            known.join(", ")
        ));
    };
    let seq = positive(t.int("training", "seq_len", 2048)?, "[training] seq_len")?;
    let model = ModelFacts {
        vocab: LLAMA3_VOCAB,
        layers: *layers,
        d: *d,
        heads: *heads,
        kv_heads: *kv,
        ff: *ff,
        seq,
        positions: 0,
        rope: *rope,
        norm: NormKind::RmsNorm,
        eps: 1e-5,
        mlp: MlpKind::Swiglu,
        bias: false,
        qkv_bias: false,
        tied: false,
        moe: None,
        attention: Default::default(),
        mtp: None,
    };
    let p = "parallelism";
    let tp = positive(t.int(p, "tensor_parallel_degree", 1)?, "tensor_parallel_degree")?;
    let pp = positive(t.int(p, "pipeline_parallel_degree", 1)?, "pipeline_parallel_degree")?;
    let cp = positive(t.int(p, "context_parallel_degree", 1)?, "context_parallel_degree")?;
    let replicate = positive(t.int(p, "data_parallel_replicate_degree", 1)?, "data_parallel_replicate_degree")?;
    let shard = match t.int(p, "data_parallel_shard_degree", -1)? {
        -1 => world / (replicate * cp * tp * pp).max(1),
        n => positive(n, "data_parallel_shard_degree")?,
    };
    if replicate * shard * cp * tp * pp != world {
        return Err(format!("dp_replicate·dp_shard·cp·tp·pp = {} is not the {world} GPUs (torchtitan/distributed/parallel_dims.py:53-56)", replicate * shard * cp * tp * pp));
    }
    let mut dropped = Vec::new();
    let sharding = if shard > 1 || cp > 1 {
        if replicate > 1 {
            dropped.push(format!(
                "HSDP: sharded over groups of {shard}, replicated {replicate} times (pipec shards over every replica)"
            ));
        }
        if t.text(p, "fsdp_reshard_after_forward", "default")? == "never" {
            Sharding::Gradients
        } else {
            Sharding::Parameters
        }
    } else {
        Sharding::None
    };
    let local = positive(t.int("training", "local_batch_size", 8)?, "[training] local_batch_size")?;
    let dp = replicate * shard;
    let global = match t.int("training", "global_batch_size", -1)? {
        -1 => local * dp,
        n => positive(n, "global_batch_size")?,
    };
    let micro = if pp > 1 {
        positive(t.int(p, "pipeline_parallel_microbatch_size", 1)?, "pipeline_parallel_microbatch_size")?
    } else {
        local
    };
    let schedule_name = t.text(p, "pipeline_parallel_schedule", "1F1B")?;
    let (schedule, chunks) = match (pp, schedule_name.to_lowercase().as_str()) {
        (1, _) => (ScheduleKind::DpOnly, 1),
        (_, "1f1b") => (ScheduleKind::OneFOneB, 1),
        (_, "gpipe") => (ScheduleKind::Gpipe, 1),
        (_, "interleaved1f1b") => {
            let per_stage = t.int(p, "pipeline_parallel_layers_per_stage", 0)?;
            let stages = if per_stage > 0 { layers / per_stage as usize } else { 2 * pp };
            (ScheduleKind::Interleaved, (stages / pp).max(2))
        }
        (_, "zbvzerobubble") => (ScheduleKind::Zbv, 2),
        (_, "dualpipev") => (ScheduleKind::DualPipeV, 2),
        (_, other) => return Err(format!("`pipeline_parallel_schedule = \"{other}\"` has no pipec schedule (1F1B, GPipe, Interleaved1F1B, ZBVZeroBubble, DualPipeV)")),
    };
    let recompute = match t.text("activation_checkpoint", "mode", "selective")?.as_str() {
        "none" => "false".to_string(),
        "full" => "true".into(),
        "selective" => {
            let option = t.text("activation_checkpoint", "selective_ac_option", "2")?;
            if option == "op" {
                // its op-level policy: every other matrix product's output and attention's
                // saved, the rest recomputed
                "{ ops: [alternate_matmul, attention] }".into()
            } else {
                dropped.push(format!("selective_ac_option = \"{option}\" (every {option}th block recomputed), as recompute on every block"));
                "true".into()
            }
        }
        other => {
            return Err(format!(
                "`[activation_checkpoint] mode = \"{other}\"` has no pipec recompute (none, full, selective)"
            ))
        }
    };
    let fp8 = fp8(&t, &mut dropped)?;
    // `[compile]`: enable, and its components (default the model and the loss,
    // job_config.py:721-727 at v0.2.2)
    let compile = if t.flag("compile", "enable") {
        match t.get("compile", "components") {
            None => (true, true),
            Some(v) => {
                let parts = v.as_array().ok_or_else(|| format!("`[compile] components = {v}`: not a list"))?;
                let mut on = (false, false);
                for c in parts {
                    match c.as_str().and_then(CompileComponent::from_name) {
                        Some(CompileComponent::Model) => on.0 = true,
                        Some(CompileComponent::Loss) => on.1 = true,
                        None => {
                            return Err(format!(
                                "`[compile] components` names {c}: torchtitan compiles \"model\" and \"loss\""
                            ))
                        }
                    }
                }
                on
            }
        }
    } else {
        (false, false)
    };
    let precision = match t.text("training", "mixed_precision_param", "bfloat16")?.as_str() {
        "float32" => Precision::Fp32,
        _ => Precision::Bf16,
    };
    if fp8.is_some() && precision != Precision::Bf16 {
        return Err(
            "float8 training with `mixed_precision_param = \"float32\"`: pipec plans FP8 products beside bf16 weights"
                .into(),
        );
    }
    let o = "optimizer";
    let run = RunFacts {
        compile,
        world,
        tp,
        pp,
        cp,
        ep: positive(t.int(p, "expert_parallel_degree", 1)?, "expert_parallel_degree")?,
        // job_config.py: 1 (experts whole) unless written; parallel_dims.py:58-59 allows 1 or tp
        etp: positive(t.int(p, "expert_tensor_parallel_degree", 1)?, "expert_tensor_parallel_degree")?,
        split_ends: (false, false),
        chunk_blocks: None,
        schedule,
        virtual_stages: chunks,
        sharding,
        sequence_parallel: tp > 1,
        tp_overlap: t.flag(p, "enable_async_tensor_parallel"),
        cp_comm: if t.text(p, "context_parallel_rotate_method", "allgather")? == "alltoall" {
            CpComm::Ring
        } else {
            CpComm::AllGather
        },
        // job_config.py:474-482: "standard" all-to-alls, or DeepEP's
        moe_dispatch: if t.text(p, "expert_parallel_comm_backend", "standard")? == "deepep" {
            pipec_plan::vocab::MoeDispatch::DeepEp
        } else {
            pipec_plan::vocab::MoeDispatch::AllToAll
        },
        ep_overlap: false,
        recompute,
        precision,
        fp8,
        grad_bf16: false,
        state_bf16: false,
        micro,
        global,
        steps: positive(t.int("training", "steps", 10000)?, "steps")?,
        optimizer: (
            "adamw",
            [
                t.float(o, "lr", 8e-4)?,
                t.float(o, "beta1", 0.9)?,
                t.float(o, "beta2", 0.95)?,
                t.float(o, "eps", 1e-8)?,
                t.float(o, "weight_decay", 0.1)?,
            ],
        ),
        clip: Some(t.float("training", "max_norm", 1.0)?),
        seed: 0,
    };
    write_spec(Engine::Torchtitan, "a torchtitan v0.2.2 job configuration", name, &model_text(&model), &run, &dropped)
}

/// torchao's FP8 as torchtitan turns it on: the `float8` converter (December 2024's name,
/// its `[float8]` section) or `quantize.linear.float8` (v0.2.2, `[quantize.linear.float8]`;
/// torchtitan/config/job_config.py:731-754 and components/quantization/float8.py:238 at
/// v0.2.2) with `recipe_name` (none: tensorwise; `rowwise`), or the MX converter
/// `quantize.linear.mx` (MXFP8). `Float8Linear` keeps its high-precision input for the
/// backward and casts each weight per product (no FP8 copy kept); FSDP gathers in FP8 with
/// `enable_fsdp_float8_all_gather`. A converter of the grouped experts' products is listed as
/// not carried over.
fn fp8(t: &Toml, dropped: &mut Vec<String>) -> Result<Option<pipec_plan::plan::Fp8Plan>, String> {
    use pipec_plan::vocab::{Fp8Recipe, Fp8Storage};
    let Some(converters) = t.get("model", "converters") else { return Ok(None) };
    let converters = converters.as_array().ok_or_else(|| format!("`[model] converters = {converters}`: not a list"))?;
    let mut found = None;
    for c in converters {
        let name = c.as_str().ok_or_else(|| format!("`[model] converters`: {c} is not a converter's name"))?;
        // the section of a converter's settings: a table, possibly nested
        let section = |path: &[&str]| -> Option<&toml::value::Table> {
            path.iter().try_fold(&t.table, |table, key| table.get(*key)?.as_table())
        };
        let setting = |path: &[&str], key: &str| section(path).and_then(|s| s.get(key));
        let recipe = match name {
            "float8" | "quantize.linear.float8" => {
                let path: &[&str] = if name == "float8" { &["float8"] } else { &["quantize", "linear", "float8"] };
                let recipe = match setting(path, "recipe_name")
                    .map(|v| v.as_str().ok_or_else(|| format!("recipe_name = {v}: not a name")))
                    .transpose()?
                {
                    None | Some("tensorwise") => Fp8Recipe::Tensorwise,
                    Some("rowwise") => Fp8Recipe::Rowwise,
                    Some(other) => {
                        return Err(format!(
                            "float8 `recipe_name = \"{other}\"` has no pipec recipe (tensorwise, rowwise)"
                        ))
                    }
                };
                let gather =
                    setting(path, "enable_fsdp_float8_all_gather").and_then(toml::Value::as_bool).unwrap_or(false);
                (recipe, if gather { Fp8Storage::Fp8 } else { Fp8Storage::Bf16 })
            }
            "quantize.linear.mx" => (Fp8Recipe::Mxfp8, Fp8Storage::Bf16),
            "quantize.grouped_mm.float8" | "quantize.grouped_mm.mx" => {
                dropped.push(format!("model.converters \"{name}\" (the experts' grouped products in FP8)"));
                continue;
            }
            other => {
                dropped.push(format!("model.converters \"{other}\""));
                continue;
            }
        };
        if found.is_some() {
            return Err("`[model] converters` names two FP8 converters of the linear layers".into());
        }
        found = Some(recipe);
    }
    Ok(found.map(|(recipe, gather)| pipec_plan::plan::Fp8Plan {
        gather,
        ..pipec_plan::plan::Fp8Plan::of_engine(pipec_plan::vocab::Engine::Torchtitan, recipe)
    }))
}
