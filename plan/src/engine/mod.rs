//! The training engines a plan can be for (`crate::vocab::Engine`): which release of each
//! pipec describes, and the engine a spec or a plan names (`EngineTarget`).
//!
//! A release is a dotted version (`0.19.2`). Each engine's description covers a range of
//! releases, read at the newest (its source says where); a spec may name a release in that
//! range, or a prefix of the newest (`0.19` for `0.19.2`), and the plan records the release
//! it resolved to.

pub mod capability;
pub mod emit;
pub mod gpt;
pub mod performance;

use std::cmp::Ordering;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::vocab::{Choice, Engine};

/// The releases of an engine pipec's description covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Releases {
    pub engine: Engine,
    /// The oldest release covered.
    pub oldest: &'static str,
    /// The newest release covered: what pipec's description was read at, and what a spec
    /// that names no version (or a prefix of this one) gets.
    pub newest: &'static str,
    /// Where the description was read: the package or tag, and why the range is what it is.
    pub source: &'static str,
}

/// Every engine's covered releases, in `Engine::ALL`'s order.
pub const RELEASES: &[Releases] = &[
    Releases {
        engine: Engine::Pipec,
        oldest: env!("CARGO_PKG_VERSION"),
        newest: env!("CARGO_PKG_VERSION"),
        source: "this repository: what `pipec run` executes (executor/src, and `pipec_executor::caveats` for what it runs differently from the plan)",
    },
    Releases {
        engine: Engine::Megatron,
        oldest: "0.19.0",
        newest: "0.19.2",
        source: "NVIDIA/Megatron-LM tag core_v0.19.0 (5be9626709af2722333bf54797c954c09edeada3) and PyPI megatron-core 0.19.2, whose megatron/training and megatron/core files cited here are byte-identical to the tag's",
    },
    Releases {
        engine: Engine::Torchtitan,
        oldest: "0.2.2",
        newest: "0.2.2",
        source: "pytorch/torchtitan tag v0.2.2 (73a0e6979dd10b6b1904098eb3c8f62c18ab87ce), the last release configured by TOML files (0.3.0 replaced them with Python config registries)",
    },
    Releases {
        engine: Engine::Deepspeed,
        oldest: "0.19.0",
        newest: "0.19.8",
        source: "PyPI deepspeed 0.19.8 (sdist sha256 9e491abd…a9af); the 0.19.0, 0.19.4, 0.19.6 and 0.19.7 sdists' file lists date DualPipeV (0.19.8) and AutoEP (0.19.4), the rows that differ in the range",
    },
];

/// The covered releases of `engine`.
pub fn releases(engine: Engine) -> &'static Releases {
    RELEASES.iter().find(|r| r.engine == engine).unwrap_or(&RELEASES[0])
}

/// A dotted version's numbers (`"0.19.2"` → `[0, 19, 2]`); None unless it is one or more
/// whole numbers joined by dots.
pub fn version_numbers(text: &str) -> Option<Vec<u64>> {
    if text.is_empty() {
        return None;
    }
    text.split('.').map(|part| if part.is_empty() { None } else { part.parse::<u64>().ok() }).collect()
}

/// Orders two dotted versions, a missing number counting as 0 (`0.19` = `0.19.0`).
pub fn compare_versions(a: &[u64], b: &[u64]) -> Ordering {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| a.get(i).copied().unwrap_or(0).cmp(&b.get(i).copied().unwrap_or(0)))
        .find(|o| o.is_ne())
        .unwrap_or(Ordering::Equal)
}

/// The engine a spec or a plan is for, at a release pipec describes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineTarget {
    pub name: Engine,
    /// The release, dotted (`0.19.2`), within `releases(name)`.
    pub version: String,
}

impl Default for EngineTarget {
    fn default() -> Self {
        EngineTarget::newest(Engine::Pipec)
    }
}

impl fmt::Display for EngineTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.name, self.version)
    }
}

impl EngineTarget {
    /// `engine` at the newest release pipec describes.
    pub fn newest(engine: Engine) -> EngineTarget {
        EngineTarget { name: engine, version: releases(engine).newest.to_string() }
    }

    /// `engine` at the release `written` names: a release in the covered range, or a prefix
    /// of the newest (`0.19` → `0.19.2`); None for no version. `Err` says why not.
    pub fn resolve(engine: Engine, written: Option<&str>) -> Result<EngineTarget, String> {
        let Some(text) = written else { return Ok(EngineTarget::newest(engine)) };
        let r = releases(engine);
        let Some(numbers) = version_numbers(text) else {
            return Err(format!("`{text}` is not a version: write dotted numbers, like `{}`", r.newest));
        };
        let newest = version_numbers(r.newest).unwrap_or_default();
        let oldest = version_numbers(r.oldest).unwrap_or_default();
        if numbers.len() < newest.len() && newest.starts_with(&numbers) {
            return Ok(EngineTarget::newest(engine));
        }
        let inside = compare_versions(&numbers, &oldest).is_ge() && compare_versions(&numbers, &newest).is_le();
        if numbers.len() >= newest.len() && inside {
            return Ok(EngineTarget { name: engine, version: text.to_string() });
        }
        Err(format!("pipec describes {engine} {}, not {text}", r.range_text()))
    }

    /// Whether this is the default: pipec itself.
    pub fn is_pipec(&self) -> bool {
        self.name == Engine::Pipec
    }

    /// Whether the release is at least `since` (a dotted version).
    pub fn at_least(&self, since: &str) -> bool {
        match (version_numbers(&self.version), version_numbers(since)) {
            (Some(v), Some(s)) => compare_versions(&v, &s).is_ge(),
            _ => false,
        }
    }

    /// The problem with a plan file's engine, if any (an unknown release).
    pub fn problem(&self) -> Option<String> {
        EngineTarget::resolve(self.name, Some(&self.version)).err().or_else(|| {
            (version_numbers(&self.version)?.len() < 3)
                .then(|| format!("engine.version `{}` must be a whole release (three numbers)", self.version))
        })
    }
}

impl Releases {
    /// `0.19.0 to 0.19.2`, or the one release.
    pub fn range_text(&self) -> String {
        if self.oldest == self.newest {
            self.newest.to_string()
        } else {
            format!("{} to {}", self.oldest, self.newest)
        }
    }
}

/// Every engine's name, for messages.
pub fn engine_names() -> Vec<&'static str> {
    Engine::ALL.iter().map(|e| e.name()).collect()
}

impl crate::Plan {
    /// The model's shape as the engines describe a language model (None: not one).
    pub fn gpt_shape(&self) -> Option<gpt::GptShape> {
        let ops: Vec<crate::model::Op> = self.layers.iter().map(|l| l.op.clone()).collect();
        gpt::GptShape::of(&ops, self.layers.iter().any(|l| l.tied.is_some()))
    }

    /// The layout the engines' capability tables judge (`capability::refusals`).
    pub fn engine_layout(&self) -> capability::Layout {
        use capability::RecomputeKind;
        let chunks = self.schedule.virtual_stages.max(1);
        let ranks = (self.stages.len() / chunks).max(1);
        let cp = self.training.context_parallel.max(1);
        let replicas: Vec<usize> =
            self.stages[..ranks.min(self.stages.len())].iter().map(|s| (s.replicas.len() / cp).max(1)).collect();
        let recomputed = self.stages.iter().filter(|s| s.recompute).count();
        // recompute inside the blocks is the tables' selective kind, its parts judged one by
        // one (`Layout::block_recompute`), as the front end holds a spec's
        // (`grammar::engine_check`)
        let recompute = if self.stages.iter().any(|s| s.selective_recompute) || self.schedule.block_recompute.is_some()
        {
            RecomputeKind::Selective
        } else if recomputed == 0 {
            RecomputeKind::Off
        } else if recomputed == self.stages.len() {
            RecomputeKind::Full
        } else {
            RecomputeKind::SomeStages
        };
        let first = self.stages.first();
        let tp = first.and_then(|s| s.tensor_parallel.first()).map_or(1, |g| g.len().max(1));
        // the expert stages' expert-parallel replicas (a stage without experts has 1: the
        // first may hold only dense blocks); with whole experts their tensor-parallel ranks
        let ep_replicas = self.stages.iter().map(|s| s.expert_parallel.max(1) as usize).max().unwrap_or(1);
        let whole = self.schedule.whole_experts && tp > 1;
        capability::Layout {
            replicas,
            tp,
            cp,
            ep: if whole { ep_replicas * tp } else { ep_replicas },
            etp: if whole { 1 } else { tp },
            schedule: self.schedule.kind,
            virtual_stages: chunks,
            microbatches: self.training.microbatches / cp,
            synchronous: self.schedule.synchronous,
            reduce: self.schedule.reduce,
            sharding: self.schedule.sharding,
            sequence_parallel: self.schedule.sequence_parallel,
            tp_overlap: self.schedule.tp_overlap,
            cp_comm: self.schedule.cp_comm,
            moe_dispatch: self.schedule.moe_dispatch,
            ep_overlap: self.schedule.ep_overlap,
            recompute,
            block_recompute: self.schedule.block_recompute.clone(),
            precision: self.training.precision,
            fp8: self.training.fp8.map(|f| f.recipe),
            master_weights: self.training.master_weights,
            grad_precision: self.training.grad_precision,
            state_precision: self.training.state_precision,
            adam: matches!(self.training.optimizer, crate::plan::OptimizerPlan::Adam { .. }),
            blocks: self.layers.iter().filter(|l| l.op.block_dims().is_some()).count(),
            chunk_blocks: Some(
                self.stages
                    .iter()
                    .map(|s| {
                        let [a, b] = s.layers;
                        self.layers.iter().filter(|l| (a..b).contains(&l.index) && l.op.block_dims().is_some()).count()
                    })
                    .collect(),
            ),
            gpt: self.gpt_shape().is_some(),
            mtp: self.model.mtp.map_or(0, |m| m.depth),
            compiled: self
                .engine_performance
                .as_ref()
                .is_some_and(|p| p.family == crate::engine::performance::KernelFamily::TorchCompiled),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_has_its_releases_and_a_newest_target() {
        for &e in Engine::ALL {
            let r = releases(e);
            assert_eq!(r.engine, e);
            let (old, new) = (version_numbers(r.oldest).expect("oldest"), version_numbers(r.newest).expect("newest"));
            assert!(compare_versions(&old, &new).is_le(), "{e}: oldest after newest");
            assert_eq!(EngineTarget::resolve(e, None), Ok(EngineTarget::newest(e)));
            assert_eq!(EngineTarget::newest(e).problem(), None);
        }
        assert_eq!(EngineTarget::default().name, Engine::Pipec);
    }

    #[test]
    fn a_written_version_resolves_to_a_covered_release_or_says_why_not() {
        let m = |v: &str| EngineTarget::resolve(Engine::Megatron, Some(v)).map(|t| t.version);
        assert_eq!(m("0.19"), Ok("0.19.2".into()));
        assert_eq!(m("0"), Ok("0.19.2".into()));
        assert_eq!(m("0.19.0"), Ok("0.19.0".into()));
        assert_eq!(m("0.19.2"), Ok("0.19.2".into()));
        assert!(m("0.19.3").expect_err("past the range").contains("0.19.0 to 0.19.2"));
        assert!(m("0.18").is_err());
        assert!(m("0.20").is_err());
        assert!(m("v0.19").expect_err("not numbers").contains("not a version"));
        assert!(m("0..19").is_err());
        let d = |v: &str| EngineTarget::resolve(Engine::Deepspeed, Some(v)).map(|t| t.version);
        assert_eq!(d("0.19.4"), Ok("0.19.4".into()));
        assert!(EngineTarget { name: Engine::Deepspeed, version: "0.19.4".into() }.at_least("0.19.4"));
        assert!(!EngineTarget { name: Engine::Deepspeed, version: "0.19.4".into() }.at_least("0.19.8"));
        // a plan file names a whole release
        assert!(EngineTarget { name: Engine::Megatron, version: "0.19".into() }.problem().is_some());
    }

    #[test]
    fn versions_order_by_their_numbers() {
        let v = |t: &str| version_numbers(t).expect("a version");
        assert!(compare_versions(&v("0.19.10"), &v("0.19.8")).is_gt());
        assert!(compare_versions(&v("0.19"), &v("0.19.0")).is_eq());
        assert_eq!(version_numbers("1.x"), None);
        assert_eq!(version_numbers(""), None);
    }
}
