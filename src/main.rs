//! The `pipec` command line: `check`, `compile`, `run`, `profile`, `explain`, `schema`,
//! `lsp` and `launch`. Each subcommand is a thin driver over the library crates.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod check_cmd;
mod compile_cmd;
mod output;

/// Exit codes, documented in README.md.
pub const EXIT_OK: u8 = 0;
pub const EXIT_DIAGNOSTICS: u8 = 1;
pub const EXIT_USAGE: u8 = 2;

#[derive(Parser)]
#[command(name = "pipec", version, about = "A compiler for distributed deep-learning training", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Output format of diagnostics.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Format {
    /// Graphical report (colour only on a terminal).
    Human,
    /// One JSON object per diagnostic per line.
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Check specs statically and report every problem with its location.
    Check {
        /// Spec files to check.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Print the long explanation of a diagnostic code, e.g. `pipec explain E0102`.
    Explain {
        /// The code (`E0102`); `--list` lists all codes.
        code: Option<String>,
        #[arg(long)]
        list: bool,
    },
    /// Print the JSON Schema of the spec format.
    Schema,
    /// Compile a spec into a verified, simulated plan: DIR/plan.json, timeline.svg,
    /// memory.svg and trace.json.
    Compile {
        file: PathBuf,
        /// Output directory (default: out/<spec name>).
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Also print one form of the result on standard output.
        #[arg(long, value_enum)]
        emit: Option<compile_cmd::Emit>,
        /// A measured per-layer profile (from `pipec profile`) replacing analytic costs.
        #[arg(long)]
        profile: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Check { files, format } => check_cmd::run(&files, format, std::io::stderr().is_terminal()),
        Command::Explain { code, list } => explain(code.as_deref(), list),
        Command::Compile { file, out, emit, profile, format } => compile_cmd::run(&file, out, emit, format, std::io::stderr().is_terminal(), profile.as_deref()),
        Command::Schema => {
            print!("{}", pipec_grammar::schema::json_schema_text());
            EXIT_OK
        }
    };
    ExitCode::from(code)
}

fn explain(code: Option<&str>, list: bool) -> u8 {
    use pipec_grammar::codes::{lookup, CODES};
    if list || code.is_none() {
        for c in CODES {
            println!("{}  {}", c.code, c.title);
        }
        return EXIT_OK;
    }
    let code = code.unwrap_or_default();
    match lookup(code) {
        Some(c) => {
            println!("{}: {}\n\n{}", c.code, c.title, c.explanation);
            EXIT_OK
        }
        None => {
            eprintln!("error: `{code}` is not a pipec diagnostic code (`pipec explain --list` lists them)");
            EXIT_USAGE
        }
    }
}
