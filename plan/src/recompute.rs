//! What every transformer block recomputes inside a stage that does not recompute its whole
//! forward (a spec's `recompute` as a mapping), and what pipec's executor runs again of it:
//! read by the plan, its declared collectives (`in_pass`), the compiler and the executor.

use serde::{Deserialize, Serialize};

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero_usize(v: &usize) -> bool {
    *v == 0
}

/// What every transformer block recomputes (a spec's `recompute` as a mapping).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockRecompute {
    /// Megatron-LM's `recompute_modules`: what these parts make is recomputed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules: Vec<crate::vocab::RecomputeModule>,
    /// torchtitan's op-level policy: only these operations' outputs are kept (empty: not
    /// op-level).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<crate::vocab::RecomputeOp>,
    /// The first `layers` transformer blocks of every stage (of each model chunk) recompute
    /// their whole forward, keeping their input only (Megatron-LM's `recompute_num_layers`
    /// with its `block` method).
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub layers: usize,
    /// Every block's kept tensors go to host memory after its forward and come back for
    /// its backward (activation offload).
    #[serde(default, skip_serializing_if = "is_false")]
    pub offload: bool,
}

impl BlockRecompute {
    /// The spec's text: `{ modules: [core_attn, mlp], layers: 2 }`.
    pub fn text(&self) -> String {
        let list = |names: Vec<&str>| format!("[{}]", names.join(", "));
        let mut parts = Vec::new();
        if !self.modules.is_empty() {
            parts.push(format!("modules: {}", list(self.modules.iter().map(|m| m.name()).collect())));
        }
        if !self.ops.is_empty() {
            parts.push(format!("ops: {}", list(self.ops.iter().map(|o| o.name()).collect())));
        }
        if self.layers > 0 {
            parts.push(format!("layers: {}", self.layers));
        }
        if self.offload {
            parts.push("offload: true".into());
        }
        format!("{{ {} }}", parts.join(", "))
    }

    /// What pipec's executor runs again of every transformer block under this policy
    /// (recompute by layers aside, which runs whole blocks again): a half of the block —
    /// its attention with the norm before it and the residual sum after it, or its MLP or
    /// mixture of experts likewise — from the half's input, which is all the half keeps.
    /// A half runs again wherever the policy recomputes anything of it but the attention
    /// core, which the executor recomputes inside its kernel instead
    /// ([`BlockRecompute::recomputes_core`]). This holds at most what the policy's module
    /// or operation list keeps (the half's input is kept under every policy) and runs more
    /// again: Megatron-LM recomputes a norm or an activation alone, keeping the product
    /// after it from saving its input; Burn's autodiff has no such product.
    pub fn executor_halves(&self) -> Halves {
        use crate::vocab::RecomputeModule as M;
        let op_level = !self.ops.is_empty();
        let named = |set: &[M]| self.modules.iter().any(|m| set.contains(m));
        Halves {
            attention: op_level || named(&[M::Layernorm, M::MlaUpProj]),
            mlp: op_level || named(&[M::Mlp, M::MoeAct, M::Layernorm, M::Moe, M::SharedExperts]),
        }
    }

    /// What pipec's executor runs again under this policy, in words for reports: "the first
    /// 2 block(s) of every stage whole, then each block's MLP half (…) from its input, the
    /// attention core inside its kernel".
    pub fn executor_words(&self) -> String {
        let halves = self.executor_halves();
        let mut parts = Vec::new();
        if self.layers > 0 {
            parts.push(format!("the first {} block(s) of every stage whole", self.layers));
        }
        let half = match (halves.attention, halves.mlp) {
            (true, true) => Some("both halves of each block (the attention, the MLP), each from its input"),
            (true, false) => Some("each block's attention half (its norm, attention and residual sum) from its input"),
            (false, true) => Some("each block's MLP half (its norm, MLP or experts and residual sum) from its input"),
            (false, false) => None,
        };
        if let Some(h) = half {
            parts.push(if self.layers > 0 { format!("then {h}") } else { h.to_string() });
        }
        if self.recomputes_core() && !halves.attention {
            parts.push("the attention core inside its kernel".into());
        }
        match parts.is_empty() {
            true => "nothing".into(),
            false => parts.join(", "),
        }
    }

    /// Whether the policy recomputes the attention core (`core_attn`), which a fused kernel
    /// recomputes anyway.
    pub fn recomputes_core(&self) -> bool {
        self.modules.contains(&crate::vocab::RecomputeModule::CoreAttn)
    }
}

impl BlockRecompute {
    /// What each layer of a stage that runs this policy (one that does not recompute its
    /// whole forward) runs again in its backward, `blocks` saying whether each of the
    /// stage's layers is a transformer block: its first `layers` blocks (all, where it has
    /// fewer) whole, as Megatron-LM counts them (an embedding before them is kept), then each
    /// block's [`BlockRecompute::executor_halves`].
    /// The executor's pieces (`executor::interp::block_recompute`) and the plan's declared
    /// collectives inside the backward (`in_pass::declare`) both read it.
    pub fn run_again(&self, blocks: &[bool]) -> Vec<RunAgain> {
        let at: Vec<usize> = blocks.iter().enumerate().filter(|(_, b)| **b).map(|(k, _)| k).collect();
        let cut = match self.layers {
            0 => 0,
            n => at.get(n - 1).or(at.last()).map_or(0, |k| k + 1),
        };
        let halves = self.executor_halves();
        blocks
            .iter()
            .enumerate()
            .map(|(k, &block)| match () {
                _ if k < cut && block => RunAgain::Whole,
                _ if block && halves.any() => RunAgain::Halves(halves),
                _ => RunAgain::Nothing,
            })
            .collect()
    }
}

/// What a layer runs again in its stage's backward ([`BlockRecompute::run_again`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunAgain {
    #[default]
    Nothing,
    /// The whole layer, from its input (recompute by layers).
    Whole,
    /// These halves of a transformer block, each from its input.
    Halves(Halves),
}

impl RunAgain {
    /// The halves of a block that run again (both where it runs again whole).
    pub fn halves(self) -> Halves {
        match self {
            RunAgain::Nothing => Halves::default(),
            RunAgain::Whole => Halves { attention: true, mlp: true },
            RunAgain::Halves(h) => h,
        }
    }
}

/// The halves of a transformer block that pipec's executor runs again in the backward
/// ([`BlockRecompute::executor_halves`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Halves {
    pub attention: bool,
    pub mlp: bool,
}

impl Halves {
    pub fn any(self) -> bool {
        self.attention || self.mlp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{RecomputeModule as M, RecomputeOp};

    #[test]
    fn what_runs_again_follows_the_halves_a_policy_touches() {
        let modules = |m: Vec<M>| BlockRecompute { modules: m, ..Default::default() };
        let halves = |b: &BlockRecompute| (b.executor_halves().attention, b.executor_halves().mlp);
        assert_eq!(halves(&modules(vec![M::CoreAttn])), (false, false));
        assert_eq!(halves(&modules(vec![M::Mlp])), (false, true));
        assert_eq!(halves(&modules(vec![M::MoeAct])), (false, true));
        assert_eq!(halves(&modules(vec![M::MlaUpProj])), (true, false));
        assert_eq!(halves(&modules(vec![M::Layernorm])), (true, true));
        let ops = BlockRecompute { ops: vec![RecomputeOp::Matmul], ..Default::default() };
        assert_eq!(halves(&ops), (true, true));
        // by layers: the first n blocks whole (an embedding before them kept), then halves
        let policy = BlockRecompute { modules: vec![M::Mlp], layers: 2, ..Default::default() };
        let h = Halves { attention: false, mlp: true };
        assert_eq!(
            policy.run_again(&[false, true, true, true, false]),
            [RunAgain::Nothing, RunAgain::Whole, RunAgain::Whole, RunAgain::Halves(h), RunAgain::Nothing]
        );
        // more blocks asked for than the stage has: all of them
        let all = BlockRecompute { layers: 5, ..Default::default() };
        assert_eq!(all.run_again(&[true, false]), [RunAgain::Whole, RunAgain::Nothing]);
        assert_eq!(
            policy.executor_words(),
            "the first 2 block(s) of every stage whole, then each block's MLP half (its norm, MLP or experts and residual sum) from its input"
        );
        assert_eq!(modules(vec![M::CoreAttn]).executor_words(), "the attention core inside its kernel");
    }
}
