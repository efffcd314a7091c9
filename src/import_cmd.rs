//! `pipec import`: a Hugging Face `config.json` becomes a spec (the translation is
//! `pipec_grammar::import::hf`); this reads the file, names the spec and writes it.

use std::path::Path;

use crate::{EXIT_OK, EXIT_USAGE};

/// Options of the written spec that the config does not say.
pub struct ImportArgs<'a> {
    pub config: &'a Path,
    pub out: Option<&'a Path>,
    /// The training sequence length (default: the config's context length, at most 4,096).
    pub seq: Option<usize>,
    pub name: Option<&'a str>,
    /// The engine and the cluster the spec plans for.
    pub target: pipec_grammar::import::hf::Target,
    /// The GPUs an engine's configuration runs on, when it does not say.
    pub gpus: Option<usize>,
    /// The Hugging Face config.json of the model a DeepSpeed config trains.
    pub model_config: Option<&'a Path>,
}

pub fn run(args: ImportArgs<'_>) -> u8 {
    let text = match std::fs::read_to_string(args.config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read `{}`: {e}", args.config.display());
            return EXIT_USAGE;
        }
    };
    let name = match args.name {
        Some(n) => match check_name(n) {
            Ok(()) => n.to_string(),
            Err(e) => {
                eprintln!("error: --name: {e}");
                return EXIT_USAGE;
            }
        },
        None => default_name(args.config),
    };
    let spec = match translate(&text, &name, &args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}: {e}", args.config.display());
            return EXIT_USAGE;
        }
    };
    match args.out {
        Some(path) => match crate::output::write_atomic(path, spec.as_bytes()) {
            Ok(()) => {
                println!("wrote {} (check it with `pipec check {}`)", path.display(), path.display());
                EXIT_OK
            }
            Err(e) => {
                eprintln!("error: {e}");
                EXIT_USAGE
            }
        },
        None => {
            print!("{spec}");
            EXIT_OK
        }
    }
}

/// The spec `text` describes, by what it is (a file of one kind is never read as another).
fn translate(text: &str, name: &str, args: &ImportArgs<'_>) -> Result<String, String> {
    use pipec_grammar::import::{deepspeed, hf, kind, megatron, torchtitan, Kind};
    let found = kind(text);
    if args.target.engine.is_some() && found != Kind::HuggingFace {
        return Err(format!(
            "--engine chooses the engine of a Hugging Face config; this is {}, which names its own",
            found.describe()
        ));
    }
    match found {
        Kind::HuggingFace => hf::import(text, name, args.seq, &args.target).map(|imported| {
            for note in &imported.notes {
                eprintln!("note: {}: {note}", args.config.display());
            }
            imported.spec
        }),
        Kind::Megatron => megatron::import(text, name, args.gpus),
        Kind::Torchtitan => torchtitan::import(text, name, args.gpus),
        Kind::DeepSpeed => {
            let path = args.model_config.ok_or("a DeepSpeed config does not describe the model: give its Hugging Face config.json with --model-config")?;
            let model = std::fs::read_to_string(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
            match kind(&model) {
                Kind::HuggingFace => deepspeed::import(text, &model, name, args.gpus, args.seq),
                other => Err(format!("--model-config `{}` is {}, not a Hugging Face config.json", path.display(), other.describe())),
            }
        }
        other @ (Kind::OtherJson | Kind::Unknown) => Err(format!(
            "this is {}: pipec imports a Hugging Face config.json, a Megatron-LM argument list or launch script, a torchtitan TOML job configuration, or a DeepSpeed ds_config.json (with --model-config)",
            other.describe()
        )),
    }
}

/// A spec's name is the run's output folder (`out/<name>`): letters, digits, `-`, `_` and
/// `.`, not starting with a dot, at most 100 characters.
fn check_name(name: &str) -> Result<(), String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 100 || name.starts_with('.') || !name.chars().all(plain) {
        return Err(format!(
            "`{name}` is not a plain folder name: use letters, digits, `-`, `_` and `.` (it names the run's output folder, out/<name>)"
        ));
    }
    Ok(())
}

/// The spec's name: the config's folder (a checkpoint's name), else `imported`.
fn default_name(config: &Path) -> String {
    let folder = config.parent().and_then(Path::file_name).and_then(|n| n.to_str()).unwrap_or("");
    let name: String =
        folder.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '-' }).collect();
    if name.is_empty() {
        "imported".into()
    } else {
        name.to_lowercase()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_that_is_not_a_plain_folder_name_is_refused() {
        for bad in ["", "../up", "a b", "a: b", ".hidden", "x/y", "tab\there"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["llama-3.1-8b", "run_2"] {
            assert_eq!(check_name(good), Ok(()));
        }
    }
}
