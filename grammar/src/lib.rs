//! pipec's front end: reads a spec file into a typed, spanned [`spec::Spec`] and reports every
//! problem as a [`diagnostic::Diagnostic`] pointing at the exact place in the file.
//!
//! Data flow: source text → [`yaml::parse`] (spanned YAML tree) → [`spec::lower`] (typed
//! sections, the layer/unit/strategy DSLs parsed with nom, blocks and named tensors
//! expanded into layers in topological order ([`graph`]), shapes inferred, cross-section
//! checks) → [`check::CheckResult`]. This crate knows nothing of tensors.

pub mod ast;
pub mod check;
pub mod codes;
mod cx;
pub mod diagnostic;
pub mod dsl;
pub mod engine_check;
mod graph;
pub mod ide;
pub mod import;
pub mod layers;
pub mod schema;
pub mod span;
pub mod spec;
mod strategy;
pub mod yaml;

pub use check::{check_source, check_source_in, CheckResult};
pub use diagnostic::{Diagnostic, Severity};
pub use span::{splice, LineIndex, Span};
pub use spec::Spec;
pub use strategy::{context_parallel_obstacle, recompute_beyond};
