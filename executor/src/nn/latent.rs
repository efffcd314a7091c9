//! Multi-head latent attention's projections (DeepSeek-V2 and V3, `kv_lora=`): the queries
//! from a small latent of the input, or from the input; the keys and values from a second
//! latent, each head's key part without rotary embeddings and its value up-projected from
//! it, and one rotary key part of the input shared by every head. What comes out is laid
//! out as a fused projection's queries, keys and values, so that the attention core
//! (`Block::attend`) is standard attention's with every head its own keys and values.

use burn::module::{Module, Param};
use burn::prelude::*;

use crate::backend::kernels::Kernels;
use crate::error::{ExecError, Result};
use crate::nn::parts::{rms_norm, Dense};

/// A block's latent projections; the tensor-parallel rank's heads of the up projections,
/// the down projection and the latents' norms whole on every rank (Megatron-LM duplicates
/// `linear_q_down_proj` and `linear_kv_down_proj` across the group).
///
/// The fields are in the order the forward multiplies (what ZeRO-3's per-product gatherer
/// reads ahead in, `crate::parallel::zero::Gatherer`, and
/// `pipec_plan::model::BlockDims::projections` lists): without a query latent the queries
/// of the input first, the backward taking them last (Burn runs the two products of the
/// input at one depth of its tape, the down projection first).
#[derive(Module, Debug)]
pub struct Latent<B: Backend> {
    /// Without a query latent (`q_lora` 0), the queries of the input: [d, heads · (head_dim
    /// + rope_dim)], head after head, each head's part without rotary embeddings first.
    pub input_queries: Option<Dense<B>>,
    /// The input to the queries' latent, the keys' and values' latent and the shared rotary
    /// key, side by side: [d, q_lora + kv_lora + rope_dim].
    pub down: Dense<B>,
    /// The two latents' RMSNorm gains side by side: [q_lora + kv_lora].
    pub norms: Param<Tensor<B, 1>>,
    /// With a query latent, the queries from it: [q_lora, heads · (head_dim + rope_dim)].
    pub latent_queries: Option<Dense<B>>,
    /// Each head's key part without rotary embeddings and its value from the keys' and
    /// values' latent: [kv_lora, heads · (head_dim + v_head)], head after head.
    pub kv_up: Dense<B>,
    #[module(skip)]
    pub q_lora: usize,
    #[module(skip)]
    pub kv_lora: usize,
    #[module(skip)]
    pub rope_dim: usize,
    /// Each query and key head's part without rotary embeddings.
    #[module(skip)]
    pub head_dim: usize,
    #[module(skip)]
    pub v_head: usize,
    /// What the queries are multiplied by: the softmax's scale beyond 1/√ of the head's
    /// size (`BlockDims::softmax_multiplier`, YaRN's mscale² for DeepSeek-V3; 1: none).
    #[module(skip)]
    pub query_scale: f64,
}

/// The latents' RMSNorms' ε: DeepSeek's 1e-6, whatever the block's `eps` (its reference
/// model and transformers' `DeepseekV3RMSNorm(q_lora_rank)` build them with the default).
pub const LATENT_EPS: f64 = 1e-6;

impl<B: Kernels> Latent<B> {
    /// The queries, keys and values of the normalised input `x` [batch, seq, d] for `heads`
    /// heads (this rank's), side by side as a fused projection's:
    /// [batch, seq, heads·qk | heads·qk | heads·v_head], qk = head_dim + rope_dim, each
    /// query and key head its part without rotary embeddings, then its rotary part (the
    /// keys' the shared one).
    pub(crate) fn queries_keys_values(&self, x: Tensor<B, 3>, heads: usize) -> Result<Tensor<B, 3>> {
        let [b, s, _] = x.dims();
        let (q_lora, kv_lora, rope) = (self.q_lora, self.kv_lora, self.rope_dim);
        let of_input = self.input_queries.as_ref().map(|p| p.forward3(x.clone()));
        let down = self.down.forward3(x);
        let gains = self.norms.val();
        let queries = match (of_input, &self.latent_queries) {
            (Some(q), _) => q,
            (None, Some(p)) => {
                p.forward3(rms_norm(down.clone().narrow(2, 0, q_lora), gains.clone().narrow(0, 0, q_lora), LATENT_EPS))
            }
            (None, None) => {
                return Err(ExecError::Plan("a latent block's queries come from its input or its query latent".into()))
            }
        };
        // the scores' extra scale, on the queries before their rotary part turns (a
        // rotation is linear): q·k times it
        let queries = if self.query_scale != 1.0 { queries * self.query_scale } else { queries };
        let kv_latent = rms_norm(down.clone().narrow(2, q_lora, kv_lora), gains.narrow(0, q_lora, kv_lora), LATENT_EPS);
        let shared = down.narrow(2, q_lora + kv_lora, rope).reshape([b, s, 1, rope]).repeat_dim(2, heads);
        let kv = self.kv_up.forward3(kv_latent).reshape([b, s, heads, self.head_dim + self.v_head]);
        let keys = Tensor::cat(vec![kv.clone().narrow(3, 0, self.head_dim), shared], 3).reshape([
            b,
            s,
            heads * (self.head_dim + rope),
        ]);
        let values = kv.narrow(3, self.head_dim, self.v_head).reshape([b, s, heads * self.v_head]);
        Ok(Tensor::cat(vec![queries, keys, values], 2))
    }
}
