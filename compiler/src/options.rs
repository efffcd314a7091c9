//! What a compile is given besides the spec.

use crate::cost::Profile;

/// Options beyond the spec.
#[derive(Debug, Clone, Default)]
pub struct CompileOptions {
    /// Measured per-layer costs replacing the analytic ones.
    pub profile: Option<Profile>,
    /// Directory of the spec file (relative data paths are resolved against it).
    pub base_dir: Option<std::path::PathBuf>,
    /// The spec's text: a strategy with `auto` fields is searched as text (each candidate
    /// goes through the front end like a written spec).
    pub source: Option<std::sync::Arc<str>>,
}
