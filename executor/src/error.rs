//! Why a worker stops: one enum for every failure inside the executor. `RunError` (lib.rs)
//! wraps it with where it happened (device, stage, step, instruction).

use crate::comm::transport::TransportError;

/// What went wrong inside a worker.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecError {
    /// The run could not start (MPI, the backend, the plan's format version).
    Setup(String),
    /// A value an instruction needs was never produced: the stream is out of order, which
    /// the verifier rules out (a hand-edited plan run with `--no-verify`).
    Missing(&'static str),
    /// The plan and this device's state disagree (a stage it does not hold, an unknown
    /// group, a message no stage sends, a gradient of the wrong size).
    Plan(String),
    /// A tensor does not fit the layer or buffer it goes to.
    Shape(String),
    /// A tensor could not be read back from the backend.
    Backend(String),
    /// The training data could not be read or does not fit the model.
    Data(String),
    /// A checkpoint could not be read, written or applied to this plan.
    Checkpoint(String),
    /// A loss came out NaN or infinite: training diverged, or the data holds such values.
    NonFinite(String),
    /// Talking to another device failed.
    Transport(TransportError),
    /// The worker panicked (a defect in pipec or in Burn); the panic's text.
    Panic(String),
}

impl ExecError {
    /// Whether this failure only follows another worker's: a worker that was stopped or
    /// lost its peer reports less than the one that failed first.
    pub fn is_secondary(&self) -> bool {
        matches!(self, ExecError::Transport(TransportError::Aborted | TransportError::Disconnected(_)))
    }

    /// A failure recorded inside a pass (a gather or an exchange that cannot return it) as
    /// the pass's error, saying `what` failed. One that only follows another worker's stays
    /// as it is, secondary, so the run reports the worker that failed first.
    pub fn recorded_in(self, what: &str) -> ExecError {
        if self.is_secondary() {
            return self;
        }
        ExecError::Transport(TransportError::Other(format!("{what}: {self}")))
    }
}

impl std::fmt::Display for ExecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExecError::Missing(what) => {
                write!(f, "{what} (the stream is out of order: run without `--no-verify` to have the plan checked)")
            }
            ExecError::Setup(m)
            | ExecError::Plan(m)
            | ExecError::Shape(m)
            | ExecError::Backend(m)
            | ExecError::Data(m) => f.write_str(m),
            ExecError::Checkpoint(m) => write!(f, "checkpoint: {m}"),
            ExecError::NonFinite(m) => write!(
                f,
                "{m}: training diverged or the data holds non-finite values (lower the learning rate, check the data)"
            ),
            ExecError::Transport(e) => e.fmt(f),
            ExecError::Panic(m) => write!(f, "the worker panicked: {m}"),
        }
    }
}

impl std::error::Error for ExecError {}

impl From<TransportError> for ExecError {
    fn from(e: TransportError) -> Self {
        ExecError::Transport(e)
    }
}

thread_local! {
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` and turns a panic into its message, without the default hook printing it to
/// stderr first: the caller reports it (as [`ExecError::Panic`] or a precise error), so the
/// user reads one message, not Rust's and then pipec's.
pub fn catch_quietly<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    outcome.map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into())
    })
}

/// The executor's result type.
pub type Result<T, E = ExecError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::DeviceId;

    #[test]
    fn only_a_stopped_or_disconnected_worker_is_secondary() {
        assert!(ExecError::from(TransportError::Aborted).is_secondary());
        assert!(ExecError::from(TransportError::Disconnected(DeviceId(1))).is_secondary());
        let timeout = TransportError::Timeout { from: DeviceId(1), waited: std::time::Duration::from_secs(3) };
        assert!(!ExecError::from(timeout).is_secondary());
        assert!(!ExecError::Missing("x").is_secondary());
        assert!(!ExecError::Shape("x".into()).is_secondary());
    }

    #[test]
    fn a_recorded_failure_that_follows_another_stays_secondary() {
        let stopped = ExecError::from(TransportError::Aborted).recorded_in("a weight's all-gather failed");
        assert!(stopped.is_secondary(), "{stopped}");
        let lost = ExecError::from(TransportError::Disconnected(DeviceId(1))).recorded_in("an exchange failed");
        assert!(lost.is_secondary(), "{lost}");
        let timeout = TransportError::Timeout { from: DeviceId(2), waited: std::time::Duration::from_secs(3) };
        let failed = ExecError::from(timeout).recorded_in("a weight's all-gather failed");
        assert!(!failed.is_secondary());
        assert_eq!(failed.to_string(), "a weight's all-gather failed: nothing arrived from d2 within 3 s");
    }

    #[test]
    fn a_missing_buffer_says_how_to_find_the_cause() {
        let text = ExecError::Missing("its input was not loaded or received").to_string();
        assert!(text.starts_with("its input was not loaded or received") && text.contains("--no-verify"), "{text}");
    }
}
