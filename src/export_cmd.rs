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
    let config = match config {
        Some(c) => Some(serde_json::to_string_pretty(&c).map_err(|e| e.to_string())? + "\n"),
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
        std::fs::rename(&tmp, out).map_err(|e| format!("cannot write `{}`: {e}", out.display()))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })?;
    Ok(format!("{} tensors{}", tensors.len(), if convolutional { ", torchvision's names" } else { " and config.json" }))
}
