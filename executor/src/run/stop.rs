//! Where a run stops when asked to (SIGINT/SIGTERM): a step boundary that no worker has
//! passed, the same for every worker of the job, after which the run writes a checkpoint of
//! the last step all of them completed.
//!
//! In one process the workers ask a [`StopGate`] under one lock. The processes of a
//! process-per-device job (MPI, TCP) cannot share a lock: they vote through a [`StopVote`],
//! in which rank 0 decides each boundary and no rank begins a step before it has rank 0's
//! decision for it (`process_run` carries the vote over the fabric).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::ExecError;

/// What a worker about to begin a step is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin {
    /// Run the step as planned.
    Run,
    /// Run it and drain the pipeline: it is the last step before a stop.
    RunLast,
    /// Stop before it.
    Stop,
}

impl Begin {
    /// The byte a vote carries it as.
    pub fn byte(self) -> u8 {
        match self {
            Begin::Run => 0,
            Begin::RunLast => 1,
            Begin::Stop => 2,
        }
    }

    pub fn from_byte(b: &[u8]) -> Result<Begin, String> {
        match b {
            [0] => Ok(Begin::Run),
            [1] => Ok(Begin::RunLast),
            [2] => Ok(Begin::Stop),
            _ => Err(format!("a stop vote of {} byte(s) that is no decision", b.len())),
        }
    }
}

/// Rank 0's rule for one boundary, from its decision at the one before (none at the run's
/// first) and whether any process was asked to stop by then. A flushed step ends with
/// nothing in flight, so the run stops at once; a flush-free pipeline (PipeDream, 2BW) runs
/// one more step that drains it (its epilogue), and stops after it. Before the first step
/// nothing is in flight either way.
pub fn decide(previous: Option<Begin>, asked: bool, flush_free: bool) -> Begin {
    match previous {
        Some(Begin::RunLast | Begin::Stop) => Begin::Stop,
        None if asked => Begin::Stop,
        Some(Begin::Run) if asked && flush_free => Begin::RunLast,
        Some(Begin::Run) if asked => Begin::Stop,
        None | Some(Begin::Run) => Begin::Run,
    }
}

/// How the processes of a job agree on where to stop. `before` is called by the process's
/// one worker before each of its steps, in order, and returns the same on every process.
pub trait StopVote: Send + Sync + std::fmt::Debug {
    /// The job's decision before the process's next step (`last`: the run's final one),
    /// given whether this process was asked to stop.
    fn before(&self, last: bool, asked: bool) -> Result<Begin, ExecError>;
}

/// Where the workers of a run stop when asked to: a step boundary that no worker has
/// passed. Workers ask before each step, under one lock, so all of them run the same
/// steps: every step some worker has begun is finished by all, and none begins a later one.
/// A flush-free pipeline must end on a step that drains it, and a worker that has already
/// begun a step began it without draining; there the run stops one step later, and that
/// last step drains. With a [`StopVote`] the job's processes decide together instead.
pub(crate) struct StopGate {
    flag: Option<Arc<AtomicBool>>,
    /// Whether the plan's steps leave microbatches in flight (a flush-free pipeline).
    flush_free: bool,
    vote: Option<Arc<dyn StopVote>>,
    /// (the highest step any worker has begun, the step no worker may begin)
    state: Mutex<(Option<usize>, Option<usize>)>,
}

impl StopGate {
    pub(crate) fn new(flag: Option<Arc<AtomicBool>>, flush_free: bool, vote: Option<Arc<dyn StopVote>>) -> Self {
        StopGate { flag, flush_free, vote, state: Mutex::new((None, None)) }
    }

    /// Whether a worker may begin `step` (`last`: the run's final one), and whether it is
    /// the last before a stop; an error when the job's vote cannot be had.
    pub(crate) fn begin(&self, step: usize, last: bool) -> Result<Begin, ExecError> {
        let asked = self.flag.as_ref().is_some_and(|f| f.load(Ordering::Relaxed));
        if let Some(vote) = &self.vote {
            let decision = vote.before(last, asked)?;
            if decision == Begin::Stop {
                self.state.lock().unwrap_or_else(PoisonError::into_inner).1 = Some(step);
            }
            return Ok(decision);
        }
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if asked && s.1.is_none() {
            let extra = usize::from(self.flush_free);
            s.1 = Some(s.0.map_or(step, |begun| begun + 1 + extra));
        }
        match s.1 {
            Some(stop) if step >= stop => return Ok(Begin::Stop),
            _ => {}
        }
        s.0 = Some(s.0.map_or(step, |begun| begun.max(step)));
        Ok(if s.1 == Some(step + 1) { Begin::RunLast } else { Begin::Run })
    }

    /// Whether the run was stopped (or will stop) before its end.
    pub(crate) fn stopped(&self) -> bool {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked() -> Arc<AtomicBool> {
        Arc::new(AtomicBool::new(false))
    }

    #[test]
    fn a_stop_ends_a_flushed_run_at_the_first_step_no_worker_began() {
        let flag = asked();
        let gate = StopGate::new(Some(flag.clone()), false, None);
        assert_eq!(gate.begin(0, false).ok(), Some(Begin::Run));
        assert_eq!(gate.begin(1, false).ok(), Some(Begin::Run));
        flag.store(true, Ordering::Relaxed);
        // a worker still at step 0 finishes the steps another has begun (the last), and no more
        assert_eq!(gate.begin(1, false).ok(), Some(Begin::RunLast));
        assert_eq!(gate.begin(2, false).ok(), Some(Begin::Stop));
        assert!(gate.stopped());
    }

    #[test]
    fn a_stop_drains_a_flush_free_pipeline_on_the_step_after_the_last_begun() {
        let flag = asked();
        let gate = StopGate::new(Some(flag.clone()), true, None);
        assert_eq!(gate.begin(0, false).ok(), Some(Begin::Run));
        assert_eq!(gate.begin(1, false).ok(), Some(Begin::Run));
        flag.store(true, Ordering::Relaxed);
        // step 1 was begun without draining: step 2 drains, every worker runs it as the last
        assert_eq!(gate.begin(1, false).ok(), Some(Begin::Run));
        assert_eq!(gate.begin(2, false).ok(), Some(Begin::RunLast));
        assert_eq!(gate.begin(2, false).ok(), Some(Begin::RunLast));
        assert_eq!(gate.begin(3, false).ok(), Some(Begin::Stop));
    }

    #[test]
    fn rank_zeros_rule_stops_at_once_after_a_flushed_step_and_one_draining_step_later_otherwise() {
        use Begin::{Run, RunLast, Stop};
        for flush_free in [false, true] {
            assert_eq!(decide(None, false, flush_free), Run);
            // before the first step nothing is in flight
            assert_eq!(decide(None, true, flush_free), Stop);
            assert_eq!(decide(Some(Run), false, flush_free), Run);
            // once decided, a stop holds whatever the flags say
            assert_eq!(decide(Some(RunLast), false, flush_free), Stop);
            assert_eq!(decide(Some(Stop), false, flush_free), Stop);
        }
        assert_eq!(decide(Some(Run), true, false), Stop);
        assert_eq!(decide(Some(Run), true, true), RunLast);
    }

    #[test]
    fn a_decision_survives_its_byte_and_a_stray_message_is_refused() {
        for b in [Begin::Run, Begin::RunLast, Begin::Stop] {
            assert_eq!(Begin::from_byte(&[b.byte()]), Ok(b));
        }
        assert!(Begin::from_byte(&[3]).is_err());
        assert!(Begin::from_byte(&[]).is_err());
    }

    /// A vote that replays fixed decisions: the gate follows it, not its own lock.
    #[derive(Debug)]
    struct Replay(Mutex<Vec<Begin>>);

    impl StopVote for Replay {
        fn before(&self, _last: bool, _asked: bool) -> Result<Begin, ExecError> {
            Ok(self.0.lock().expect("lock").remove(0))
        }
    }

    #[test]
    fn a_gate_with_a_vote_follows_the_jobs_decision() {
        let votes = vec![Begin::Run, Begin::RunLast, Begin::Stop];
        let gate = StopGate::new(Some(asked()), true, Some(Arc::new(Replay(Mutex::new(votes)))));
        assert_eq!(gate.begin(0, false).ok(), Some(Begin::Run));
        assert!(!gate.stopped());
        assert_eq!(gate.begin(1, false).ok(), Some(Begin::RunLast));
        assert_eq!(gate.begin(2, false).ok(), Some(Begin::Stop));
        assert!(gate.stopped());
    }
}
