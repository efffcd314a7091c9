//! Specs from the configurations other tools keep: a Hugging Face model's `config.json`
//! ([`hf`]), and the launch configurations of the engines pipec plans for — a Megatron-LM
//! argument list or launch script ([`megatron`]), a torchtitan v0.2.2 TOML job configuration
//! ([`torchtitan`]), a DeepSpeed `ds_config.json` with its model's Hugging Face config
//! ([`deepspeed`]). Each translator writes a spec's text that checks, or says which field it
//! cannot honour and why; [`kind`] tells the files apart by their content.

pub mod deepspeed;
pub mod engine;
pub mod hf;
pub mod megatron;
pub mod torchtitan;

/// What a configuration file is, by its content (never by its name alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A Hugging Face `config.json` (`model_type`).
    HuggingFace,
    /// A DeepSpeed `ds_config.json` (batch or ZeRO keys).
    DeepSpeed,
    /// Another JSON document.
    OtherJson,
    /// A torchtitan TOML job configuration (`[model]`, `[parallelism]` or `[training]`).
    Torchtitan,
    /// A Megatron-LM argument list or launch script (`--num-layers`, `--hidden-size`).
    Megatron,
    Unknown,
}

impl Kind {
    pub fn describe(self) -> &'static str {
        match self {
            Kind::HuggingFace => "a Hugging Face config.json",
            Kind::DeepSpeed => "a DeepSpeed ds_config.json",
            Kind::OtherJson => "a JSON document that is neither a Hugging Face nor a DeepSpeed config",
            Kind::Torchtitan => "a torchtitan TOML job configuration",
            Kind::Megatron => "a Megatron-LM argument list",
            Kind::Unknown => "none of the configurations pipec imports",
        }
    }
}

/// What `text` is.
pub fn kind(text: &str) -> Kind {
    if let Ok(serde_json::Value::Object(m)) = serde_json::from_str::<serde_json::Value>(text) {
        return if m.contains_key("model_type") {
            Kind::HuggingFace
        } else if [
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "zero_optimization",
            "gradient_accumulation_steps",
        ]
        .iter()
        .any(|k| m.contains_key(*k))
        {
            Kind::DeepSpeed
        } else {
            Kind::OtherJson
        };
    }
    if let Ok(t) = text.parse::<toml::Table>() {
        if ["model", "parallelism", "training", "job"].iter().any(|k| t.get(*k).is_some_and(toml::Value::is_table)) {
            return Kind::Torchtitan;
        }
    }
    let words = megatron::words(text);
    if words.iter().any(|w| w == "--num-layers" || w == "--hidden-size") {
        return Kind::Megatron;
    }
    Kind::Unknown
}
