//! Specs from the configurations other tools keep: a Hugging Face model's `config.json`
//! ([`hf`]). Each translator writes a spec's text that checks, or says which field it cannot
//! honour and why.

pub mod hf;
