//! Context parallelism's ring (`cp_comm: ring`; Megatron-LM's `p2p`, ring attention): a
//! member's attention passes the keys and values around its group instead of gathering
//! them, and keeps only its own for the backward.
//!
//! Forward: the member's queries meet its own block of keys and values first, then the
//! block each neighbour passes on (member `position − j` at step j), `cp − 1` passes in
//! all, each started on the collective thread before the attention over the block it
//! carries and waited for after it (the transfer under the computation). Under a causal
//! mask each half of the member's queries (its two load-balanced chunks) skips the key
//! halves wholly after it — half of every other member's block, a quarter of its own —
//! and masks only where a half meets the diagonal. The blocks' results are merged by the online softmax (a running row maximum `m`,
//! a running denominator `l` and a running output, rescaled as a larger maximum arrives:
//! Milakov and Gimelshein 2018, as FlashAttention and ring attention merge their blocks).
//! What the backward keeps: the queries, the member's own keys and values, the output and
//! each row's log-sum-exp `m + ln l` — never another member's keys or values.
//!
//! Backward: the group's keys and values are gathered again for the pass (and dropped
//! after it), each block's probabilities recomputed from the kept log-sum-exp, and each
//! block's key and value gradients sent to their member and summed there — the all-gather
//! and reduce-scatter the plan prices for the ring's backward (`LayerCost::core_s`).
//!
//! With a block's dropout ([`AttentionDropout`]) each block's probabilities are dropped after
//! their share of the denominator is summed, by the whole mask's part at this member's
//! queries and the block's keys, drawn again in the backward.
//!
//! With attention sinks (a logit per head in every row's softmax, with no value: GPT-OSS's)
//! the sink joins each row's denominator once, after the last block: the running maximum
//! rises to it where it is larger and the output is rescaled, as one more block of one key
//! would be. The kept log-sum-exp includes it, so the backward's probabilities are the
//! one device's; the sink's gradient is −Σ p_sink · rowsum(dO ⊙ O) over this member's rows.
//!
//! Every step of it computes what the all-gather's attention computes, block by block, so
//! the two give the same numbers up to float rounding (tested against one device).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::backend::dropout::AttentionDropout;
use crate::backend::port::{mismatch, PeerGroup};
use crate::comm::exchanger::Ticket;
use crate::error::ExecError;

/// The online softmax's running state of a part of the queries: each row's maximum score,
/// its denominator and its unnormalised output.
type Online<B> = (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>);

/// The gradients of a member's queries, keys and values, and of the sinks where the
/// attention has them.
pub type Grads<B> = (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>, Option<Tensor<B, 1>>);

/// What a member's ring attention needs beside its tensors.
#[derive(Clone, Debug)]
pub struct Ring {
    pub group: PeerGroup,
    /// Each member's positions of the sequence (member order): its queries' and keys'.
    pub positions: Vec<Vec<usize>>,
    /// A causal mask by true position (a key after its query weighs nothing).
    pub causal: bool,
    /// A sliding window under the causal mask (0: none): a key `window` or more positions
    /// before its query weighs nothing either.
    pub window: usize,
    /// Query heads per key/value head (grouped-query attention: each key and value head
    /// serves this many query heads).
    pub group_size: usize,
    /// The probabilities' dropout, if any (a block's `dropout=`, in training), cut to this
    /// member's queries against each block's keys; the softmax's denominator is made of the
    /// probabilities before it, as one device makes them.
    pub dropout: Option<AttentionDropout>,
}

impl Ring {
    fn position(&self) -> usize {
        self.group.position
    }

    /// The group's size.
    fn cp(&self) -> usize {
        self.positions.len()
    }

    /// How queries at positions `queries` meet keys at `keys`: None when every key is after
    /// every query, or with a sliding window too far before every query (nothing to
    /// compute), else whether the mask is needed (some key after some query, or out of some
    /// query's window). Without a causal mask every query meets every key.
    fn meets(&self, queries: &[usize], keys: &[usize]) -> Option<bool> {
        if !self.causal {
            return Some(false);
        }
        let (&q_first, &q_last) = (queries.iter().min()?, queries.iter().max()?);
        let (&k_first, &k_last) = (keys.iter().min()?, keys.iter().max()?);
        let windowed = self.window > 0;
        if k_first > q_last || (windowed && q_first >= k_last + self.window) {
            None
        } else {
            Some(k_last > q_first || (windowed && q_last >= k_first + self.window))
        }
    }

    /// The parts a member's positions split into: under a causal mask the load-balanced
    /// chunks' halves (a member holds chunks c and 2·cp − 1 − c, the first half of its
    /// positions and the second), so that a query half meets a key half whole, on the
    /// diagonal or not at all, and what it does not meet is never computed (half of every
    /// other member's block); otherwise all of them.
    fn halves(&self, positions: usize) -> Vec<std::ops::Range<usize>> {
        if self.causal && positions >= 2 && positions.is_multiple_of(2) {
            vec![0..positions / 2, positions / 2..positions]
        } else {
            std::iter::once(0..positions).collect()
        }
    }

    /// The key range of member `m`'s block that query part `qr` meets (the key halves it
    /// meets, which are contiguous), and whether the mask is needed; None: none.
    fn keys_met(&self, qr: &std::ops::Range<usize>, m: usize) -> Option<(std::ops::Range<usize>, bool)> {
        let queries = &self.positions[self.position()][qr.clone()];
        let keys = &self.positions[m];
        let met: Vec<(std::ops::Range<usize>, bool)> = self
            .halves(keys.len())
            .into_iter()
            .filter_map(|kr| self.meets(queries, &keys[kr.clone()]).map(|masked| (kr, masked)))
            .collect();
        let (first, last) = (met.first()?, met.last()?);
        Some((first.0.start..last.0.end, met.iter().any(|(_, masked)| *masked)))
    }

    /// The additive mask of this member's queries `qr` against member `m`'s keys `kr`,
    /// [1, 1, q, k].
    fn mask<B: Backend>(
        &self,
        qr: &std::ops::Range<usize>,
        m: usize,
        kr: &std::ops::Range<usize>,
        dev: &B::Device,
    ) -> Tensor<B, 4> {
        let mask = crate::backend::attention::Mask {
            queries: &self.positions[self.position()][qr.clone()],
            keys: &self.positions[m][kr.clone()],
            window: self.window,
        };
        crate::backend::attention::additive_mask::<B>(mask, dev)
    }

    /// The dropout's factors [b, h, q, k] (`dims`) of this member's queries `qr` against
    /// member `m`'s keys `kr`, if the ring drops.
    fn dropout<B: Backend>(
        &self,
        dims: [usize; 4],
        (qr, m, kr): (&std::ops::Range<usize>, usize, &std::ops::Range<usize>),
        dev: &B::Device,
    ) -> Option<Tensor<B, 4>> {
        let d = self.dropout.as_ref()?;
        let seq = self.positions.iter().map(Vec::len).sum();
        let queries = self.positions[self.position()][qr.clone()].to_vec();
        let mask = d.mask(dims[0], seq, queries, self.positions[m][kr.clone()].to_vec());
        Some(mask.tensor::<B>(dev).reshape(dims))
    }

    /// Keys or values [b, kv, s, dh] repeated to the query heads [b, h, s, dh].
    fn repeat<B: Backend>(&self, t: Tensor<B, 4>) -> Tensor<B, 4> {
        crate::backend::attention::repeat_heads(t, self.group_size)
    }

    /// A gradient at the query heads [b, h, s, dh] summed onto the key/value heads.
    fn fold<B: Backend>(&self, t: Tensor<B, 4>) -> Tensor<B, 4> {
        if self.group_size == 1 {
            return t;
        }
        let [b, h, s, dh] = t.dims();
        let kv = h / self.group_size;
        t.reshape([b, kv, self.group_size, s, dh]).sum_dim(2).reshape([b, kv, s, dh])
    }

    /// The scaled scores of queries `q` (this member's part `qr`) against keys `k` (already
    /// repeated; member `m`'s part `kr`), masked where `masked`.
    fn scores<B: Backend>(
        &self,
        q: &Tensor<B, 4>,
        k: Tensor<B, 4>,
        (qr, m, kr, masked): (&std::ops::Range<usize>, usize, &std::ops::Range<usize>, bool),
    ) -> Tensor<B, 4> {
        let dh = q.dims()[3];
        let s = crate::backend::amp::matmul(q.clone(), k.swap_dims(2, 3)) / (dh as f64).sqrt();
        if masked {
            s + self.mask::<B>(qr, m, kr, &q.device())
        } else {
            s
        }
    }

    /// Starts sending `values` to the next member (and receiving what the previous one
    /// sends) on the collective thread; [`Ring::passed`] waits for it.
    fn pass(&self, values: Vec<f32>) -> Result<Ticket<Vec<Vec<f32>>>, ExecError> {
        let next = (self.position() + 1) % self.cp();
        let mut chunks = vec![Vec::new(); self.cp()];
        chunks[next] = values;
        self.group.start(pipec_plan::PassOp::RingPass, chunks).map_err(ExecError::from)
    }

    /// What the previous member passed ([`Ring::pass`]).
    fn passed(&self, ticket: Ticket<Vec<Vec<f32>>>) -> Result<Vec<f32>, ExecError> {
        let prev = (self.position() + self.cp() - 1) % self.cp();
        let mut got = ticket.wait()?;
        Ok(std::mem::take(&mut got[prev]))
    }

    /// Every member's `values`, member after member.
    fn all_gather(&self, values: Vec<f32>) -> Result<Vec<Vec<f32>>, ExecError> {
        self.group.all_gather(values).map_err(ExecError::from)
    }

    /// Sends `chunks[m]` to member m and returns the sum of what every member sent this one.
    fn reduce_scatter(&self, chunks: Vec<Vec<f32>>) -> Result<Vec<f32>, ExecError> {
        let got = self.group.exchange(pipec_plan::PassOp::ReduceScatter, chunks)?;
        let mut sum = vec![0f32; got.first().map_or(0, Vec::len)];
        for part in &got {
            if part.len() != sum.len() {
                return Err(mismatch("a context-parallel member sent key gradients of another size".into()));
            }
            sum.iter_mut().zip(part).for_each(|(a, b)| *a += b);
        }
        Ok(sum)
    }

    /// The forward: the attention output [b, h, s, dh] of queries `q` [b, h, s, dh] over
    /// the group's keys and values (and the heads' `sinks` [h], if any), and each row's
    /// log-sum-exp [b, h, s, 1]; `k`, `v` [b, kv, s, dh] are this member's.
    pub fn forward<B: Backend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        sinks: Option<Tensor<B, 1>>,
    ) -> Result<(Tensor<B, 4>, Tensor<B, 4>), ExecError> {
        let dev = q.device();
        // keys and values of their own sizes (multi-head latent attention's value heads)
        let (k_shape, v_shape) = (k.dims(), v.dims());
        let (nk, nv) = (k_shape.iter().product::<usize>(), v_shape.iter().product::<usize>());
        let (mut k_blk, mut v_blk) = (k, v);
        // per part of the queries, the running (m, l, o)
        let parts = self.halves(q.dims()[2]);
        let mut state: Vec<Option<Online<B>>> = vec![None; parts.len()];
        for j in 0..self.cp() {
            let m_id = (self.position() + self.cp() - j) % self.cp();
            // the block goes on to the next member while this one computes with it
            let passing = if j + 1 < self.cp() {
                let mut values = crate::backend::port::host_f32(k_blk.clone().into_data())?;
                values.extend(crate::backend::port::host_f32(v_blk.clone().into_data())?);
                Some(self.pass(values)?)
            } else {
                None
            };
            for (qr, st) in parts.iter().zip(state.iter_mut()) {
                let Some((kr, masked)) = self.keys_met(qr, m_id) else { continue };
                let narrow = |t: &Tensor<B, 4>| self.repeat(t.clone().narrow(2, kr.start, kr.len()));
                let q_part = q.clone().narrow(2, qr.start, qr.len());
                let s = self.scores(&q_part, narrow(&k_blk), (qr, m_id, &kr, masked));
                let m_j = s.clone().max_dim(3);
                let p = (s - m_j.clone()).exp();
                let l_j = p.clone().sum_dim(3);
                // the dropout after the denominator: the kept weights' share of it
                let p = match self.dropout::<B>(p.dims(), (qr, m_id, &kr), &dev) {
                    Some(f) => p * f,
                    None => p,
                };
                let o_j = crate::backend::amp::matmul(p, narrow(&v_blk));
                *st = Some(match st.take() {
                    None => (m_j, l_j, o_j),
                    Some(before) => merged(before, (m_j, l_j, Some(o_j))),
                });
            }
            if let Some(ticket) = passing {
                let got = self.passed(ticket)?;
                if got.len() != nk + nv {
                    return Err(mismatch(format!(
                        "a context-parallel member passed {} key and value values, not {}",
                        got.len(),
                        nk + nv
                    )));
                }
                let (kv, vv) = got.split_at(nk);
                k_blk = Tensor::from_data(TensorData::new(kv.to_vec(), k_shape), &dev);
                v_blk = Tensor::from_data(TensorData::new(vv.to_vec(), v_shape), &dev);
            }
        }
        // (every part met its own block's diagonal: each query sees its own position)
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for st in state {
            let (m, l, o) =
                st.ok_or_else(|| mismatch("a part of a context-parallel member's queries met no key".into()))?;
            // a sink: one more block of one key at the sink's score, with no value
            let (m, l, o) = match &sinks {
                Some(sinks) => {
                    let sink = per_row(sinks.clone(), m.dims());
                    merged((m, l, o), (sink.clone(), sink.ones_like(), None))
                }
                None => (m, l, o),
            };
            outs.push(o / l.clone());
            lses.push(m + l.log());
        }
        Ok((Tensor::cat(outs, 2), Tensor::cat(lses, 2)))
    }

    /// The backward: the gradients of `q`, `k` and `v` (this member's) and of the `sinks`
    /// from the output's gradient `d_out`, given the forward's output `out` and
    /// log-sum-exp `lse`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<B: Backend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        sinks: Option<Tensor<B, 1>>,
        out: Tensor<B, 4>,
        lse: Tensor<B, 4>,
        d_out: Tensor<B, 4>,
    ) -> Result<Grads<B>, ExecError> {
        let dev = q.device();
        let (k_shape, v_shape) = (k.dims(), v.dims());
        let (nk, nv) = (k_shape.iter().product::<usize>(), v_shape.iter().product::<usize>());
        let dh = q.dims()[3];
        let mut values = crate::backend::port::host_f32(k.into_data())?;
        values.extend(crate::backend::port::host_f32(v.into_data())?);
        let all = self.all_gather(values)?;
        // rowsum(dO ⊙ O): the softmax's backward term
        let delta = (d_out.clone() * out).sum_dim(3);
        // a sink's probability has no value: its gradient is p_sink · (0 − rowsum(dO ⊙ O))
        let d_sinks = sinks.map(|s| {
            let h = s.dims()[0];
            let p_sink = (per_row(s, delta.dims()) - lse.clone()).exp();
            (p_sink * delta.clone()).sum_dim(0).sum_dim(2).reshape([h]).neg()
        });
        let parts = self.halves(q.dims()[2]);
        let mut dq: Vec<Tensor<B, 4>> =
            parts.iter().map(|qr| q.clone().narrow(2, qr.start, qr.len()).zeros_like()).collect();
        let mut sends = Vec::with_capacity(self.cp());
        for (m_id, kv) in all.iter().enumerate() {
            if kv.len() != nk + nv {
                return Err(mismatch(format!(
                    "a context-parallel member sent {} key and value values, not {}",
                    kv.len(),
                    nk + nv
                )));
            }
            let (kv_k, kv_v) = kv.split_at(nk);
            let k_m = Tensor::<B, 4>::from_data(TensorData::new(kv_k.to_vec(), k_shape), &dev);
            let v_m = Tensor::<B, 4>::from_data(TensorData::new(kv_v.to_vec(), v_shape), &dev);
            // the block's key and value gradients, at the query heads
            let (mut dk, mut dv) = (self.repeat(k_m.zeros_like()), self.repeat(v_m.zeros_like()));
            for (qr, dq_part) in parts.iter().zip(dq.iter_mut()) {
                let Some((kr, masked)) = self.keys_met(qr, m_id) else { continue };
                let narrow = |t: &Tensor<B, 4>, r: &std::ops::Range<usize>| t.clone().narrow(2, r.start, r.len());
                let (k_r, v_r) = (self.repeat(narrow(&k_m, &kr)), self.repeat(narrow(&v_m, &kr)));
                let (q_p, d_out_p) = (narrow(&q, qr), narrow(&d_out, qr));
                let s = self.scores(&q_p, k_r.clone(), (qr, m_id, &kr, masked));
                let p = (s - narrow(&lse, qr)).exp();
                // with dropout (factors F): dV from P ⊙ F, dP = F ⊙ dO·vᵀ, and rowsum(dO ⊙ O)
                // is still rowsum(P ⊙ dP)
                let factors = self.dropout::<B>(p.dims(), (qr, m_id, &kr), &dev);
                let dropped = |t: Tensor<B, 4>| match &factors {
                    Some(f) => t * f.clone(),
                    None => t,
                };
                let dv_r = crate::backend::amp::matmul(dropped(p.clone()).swap_dims(2, 3), d_out_p.clone());
                let dp = dropped(crate::backend::amp::matmul(d_out_p, v_r.swap_dims(2, 3)));
                let ds = p * (dp - narrow(&delta, qr)) / (dh as f64).sqrt();
                *dq_part = dq_part.clone() + crate::backend::amp::matmul(ds.clone(), k_r);
                let dk_r = crate::backend::amp::matmul(ds.swap_dims(2, 3), q_p);
                dk = dk.clone().slice_assign(rows_of(&dk, &kr), narrow(&dk, &kr) + dk_r);
                dv = dv.clone().slice_assign(rows_of(&dv, &kr), narrow(&dv, &kr) + dv_r);
            }
            let mut part = crate::backend::port::host_f32(self.fold(dk).into_data())?;
            part.extend(crate::backend::port::host_f32(self.fold(dv).into_data())?);
            sends.push(part);
        }
        let mine = self.reduce_scatter(sends)?;
        if mine.len() != nk + nv {
            return Err(mismatch("a context-parallel member's key gradients have the wrong size".into()));
        }
        let (dk, dv) = mine.split_at(nk);
        Ok((
            Tensor::cat(dq, 2),
            Tensor::from_data(TensorData::new(dk.to_vec(), k_shape), &dev),
            Tensor::from_data(TensorData::new(dv.to_vec(), v_shape), &dev),
            d_sinks,
        ))
    }
}

/// The online softmax's state `before` with one more block merged: its rows' maxima `m_j`,
/// denominators `l_j` (each row's sum of exp(score − m_j)) and unnormalised output `o_j`
/// (None: a block without values, a sink's), both rescaled to the larger maximum.
fn merged<B: Backend>(
    before: Online<B>,
    (m_j, l_j, o_j): (Tensor<B, 4>, Tensor<B, 4>, Option<Tensor<B, 4>>),
) -> Online<B> {
    let (m, l, o) = before;
    let m_new = m.clone().max_pair(m_j.clone());
    let (a, b) = ((m - m_new.clone()).exp(), (m_j - m_new.clone()).exp());
    let o = match o_j {
        Some(o_j) => o * a.clone() + o_j * b.clone(),
        None => o * a.clone(),
    };
    (m_new, l * a + l_j * b, o)
}

/// Each head's sink [h] at every row of a [b, h, s, 1] tensor of that `shape`.
fn per_row<B: Backend>(sinks: Tensor<B, 1>, shape: [usize; 4]) -> Tensor<B, 4> {
    let [_, h, _, _] = shape;
    sinks.reshape([1, h, 1, 1]).expand(shape)
}

/// The slice of a [b, h, s, d] tensor that takes rows `rows` of its third dimension whole
/// in the others.
fn rows_of<B: Backend>(t: &Tensor<B, 4>, rows: &std::ops::Range<usize>) -> [std::ops::Range<usize>; 4] {
    let [b, h, _, d] = t.dims();
    [0..b, 0..h, rows.clone(), 0..d]
}
