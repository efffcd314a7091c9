//! `pipec export`: a checkpoint as a Hugging Face checkpoint folder — `model.safetensors`
//! under `transformers`' names and its `config.json` — for a GPT-2, Llama-family or BERT
//! model, or a ResNet's `model.safetensors` under torchvision's names, whatever layout
//! trained it (tensor-parallel shards are joined).

use std::path::{Path, PathBuf};

use pipec_plan::Plan;

use crate::{EXIT_OK, EXIT_USAGE};

pub fn run(checkpoint: &Path, out: &Path, plan: Option<&Path>) -> u8 {
    match export(checkpoint, out, plan) {
        Ok(n) => {
            println!("wrote {} ({n})", out.display());
            EXIT_OK
        }
        Err(e) => {
            eprintln!("error: {e}");
            EXIT_USAGE
        }
    }
}

/// The run's `plan.json`: the one given, else the nearest one above the checkpoint (a run
/// folder holds `plan.json` and its checkpoints below it).
fn find_plan(checkpoint: &Path, given: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    checkpoint.ancestors().map(|a| a.join("plan.json")).find(|p| p.is_file()).ok_or_else(|| {
        format!(
            "no plan.json above `{}`: name the run's plan with --plan (it says which model the weights are)",
            checkpoint.display()
        )
    })
}

fn export(checkpoint: &Path, out: &Path, plan: Option<&Path>) -> Result<String, String> {
    let found = pipec_plan::checkpoint::locate(checkpoint)?;
    let plan_path = find_plan(&found, plan)?;
    let text = crate::check_cmd::read_text(&plan_path, crate::check_cmd::MAX_PLAN_BYTES, true)?;
    let plan = Plan::from_json(&text).map_err(|e| format!("`{}`: {e}", plan_path.display()))?;
    let loaded = pipec_plan::checkpoint::read(&found).map_err(|e| format!("checkpoint `{}`: {e}", found.display()))?;
    loaded.check_fits(&plan).map_err(|e| format!("checkpoint `{}`: {e}", found.display()))?;
    let weights = pipec_executor::whole_weights(&loaded, &plan).map_err(|e| e.to_string())?;
    let ops = plan.model_ops();
    let convolutional = ops.iter().any(|op| matches!(op, pipec_plan::model::Op::Conv2d { .. }))
        && !ops.iter().any(|op| matches!(op, pipec_plan::model::Op::TransformerBlock { .. }));
    let (config, tensors) = if convolutional {
        // a ResNet: torchvision's state_dict names, no config (torchvision builds the model)
        let inputs: Vec<_> = plan.layers.iter().map(|l| l.inputs.clone()).collect();
        let t = &plan.training;
        let per_forward = t.recipe.running_stats == pipec_plan::recipe::RunningStats::PerForward;
        let forwards = loaded.completed_steps as u64 * if per_forward { t.microbatches as u64 } else { 1 };
        (None, pipec_plan::hf::torchvision_from_pipec(&ops, &inputs, &weights, forwards)?)
    } else {
        let tied = plan.layers.last().is_some_and(|l| l.tied.is_some());
        let context = plan.model.input.first().copied().unwrap_or(1);
        let (config, tensors) = pipec_plan::hf::from_pipec(&ops, tied, context, &weights)?;
        (Some(config), tensors)
    };
    let model = pipec_plan::hf::write_safetensors(&tensors)?;
    // what the run started from: its tokenizer files and its config's token ids and context
    let carried = match &config {
        Some(_) => carry_over(&plan),
        None => Carried::default(),
    };
    let config = match config {
        Some(mut c) => {
            for (key, value) in &carried.fields {
                c[key.as_str()] = value.clone();
            }
            Some(serde_json::to_string_pretty(&c).map_err(|e| e.to_string())? + "\n")
        }
        None => None,
    };
    // both files into a fresh folder beside the target, renamed into place at once: a
    // failed export leaves nothing half-written
    if out.exists() {
        return Err(format!("`{}` exists: export writes a new folder", out.display()));
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| format!("cannot create `{}`: {e}", parent.display()))?;
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("export");
    let tmp = parent.join(format!(".{name}.tmp{}", std::process::id()));
    let write = || -> Result<(), String> {
        std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create `{}`: {e}", tmp.display()))?;
        std::fs::write(tmp.join("model.safetensors"), &model).map_err(|e| format!("cannot write: {e}"))?;
        if let Some(config) = &config {
            std::fs::write(tmp.join("config.json"), config.as_bytes()).map_err(|e| format!("cannot write: {e}"))?;
        }
        for (name, bytes) in &carried.files {
            std::fs::write(tmp.join(name), bytes).map_err(|e| format!("cannot write: {e}"))?;
        }
        std::fs::rename(&tmp, out).map_err(|e| format!("cannot write `{}`: {e}", out.display()))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })?;
    let mut what = format!(
        "{} tensors{}",
        tensors.len(),
        if convolutional { ", torchvision's names" } else { " and config.json" }
    );
    if !carried.files.is_empty() {
        let names: Vec<&str> = carried.files.iter().map(|(n, _)| n.as_str()).collect();
        what.push_str(&format!("; {} from {}", names.join(", "), carried.from));
    }
    if !carried.fields.is_empty() {
        let keys: Vec<&str> = carried.fields.iter().map(|(k, _)| k.as_str()).collect();
        what.push_str(&format!("; config.json's {} from {}", keys.join(", "), carried.from));
    }
    for note in &carried.notes {
        eprintln!("note: {note}");
    }
    Ok(what)
}

/// What an export carries over from where the run started: tokenizer files to copy and
/// config fields to set, and notes on what it could not.
#[derive(Debug, Default)]
struct Carried {
    files: Vec<(String, Vec<u8>)>,
    fields: Vec<(String, serde_json::Value)>,
    /// Where they came from, as the report says it.
    from: String,
    notes: Vec<String>,
}

/// A Hugging Face folder's tokenizer files, copied whole when present.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "generation_config.json",
];

/// The config fields that describe the checkpoint's use rather than its layers: its special
/// tokens and the context it was trained for (not the run's training window).
const CONFIG_FIELDS: &[&str] = &["bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"];

/// The tokenizer and config fields of the `--init` folder the plan remembers; without one,
/// the data's `tokenizer.json` (with a `tokenizer_config.json` naming the generic fast
/// tokenizer, so `AutoTokenizer` loads it).
fn carry_over(plan: &Plan) -> Carried {
    let mut carried = Carried::default();
    if let Some(init) = &plan.training.init_from {
        let folder = Path::new(init);
        if !folder.is_dir() {
            carried.notes.push(format!(
                "the run started from `{init}`, which is gone: its tokenizer and config fields are not carried over"
            ));
            return carried;
        }
        carried.from = format!("`{init}` (the run's --init)");
        for name in TOKENIZER_FILES {
            if let Ok(bytes) = std::fs::read(folder.join(name)) {
                carried.files.push((name.to_string(), bytes));
            }
        }
        let config = std::fs::read_to_string(folder.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        if let Some(config) = config {
            // the original context, never one shorter than the model's window
            let window = plan.model.input.first().copied().unwrap_or(0) as u64;
            for key in CONFIG_FIELDS {
                match config.get(*key) {
                    Some(v) if *key == "max_position_embeddings" && v.as_u64().is_none_or(|n| n < window) => {}
                    Some(v) if !v.is_null() => carried.fields.push((key.to_string(), v.clone())),
                    _ => {}
                }
            }
        }
        return carried;
    }
    if let pipec_plan::plan::DataPlan::Text { tokenizer: Some(path), .. } = &plan.training.data {
        match std::fs::read(path) {
            Ok(bytes) => {
                carried.from = format!("the data's tokenizer `{path}`");
                carried.files.push(("tokenizer.json".into(), bytes));
                carried.files.push((
                    "tokenizer_config.json".into(),
                    b"{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\"\n}\n".to_vec(),
                ));
            }
            Err(e) => carried.notes.push(format!("the data's tokenizer `{path}` is not carried over: {e}")),
        }
    }
    carried
}
