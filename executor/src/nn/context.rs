//! Context parallelism: each microbatch's sequence split over a group of a stage's
//! replicas (`TrainingPlan::context_parallel`; groups of cp consecutive replicas, the
//! member at position c computing positions `context_positions(seq, cp, c)` of every
//! sequence). Every layer but attention works on the member's own positions; a transformer
//! block's attention gathers the group's keys and values ([`Context::gather`]: every member
//! sends its keys and values to every other in one exchange) and masks by the positions'
//! true order. The gather is an autodiff node ([`Kernels::exchange`]) whose backward sends
//! each member the gradients of its keys and values, summed there: a reduce-scatter.

use burn::tensor::Tensor;
use pipec_plan::{DeviceId, Plan, StageId};

use crate::backend::kernels::Kernels;
use crate::backend::port::{Exchange, PeerGroup};
use crate::comm::exchanger::Exchanger;
use crate::error::{ExecError, Result};

/// A device's context-parallel group for a stage, and its positions.
#[derive(Clone, Debug)]
pub struct Context {
    /// The members, in position order, and how to reach them.
    pub group: PeerGroup,
    pub cp: usize,
    /// `cp_comm: ring`: attention passes keys and values around the group
    /// ([`crate::backend::ring`]) instead of gathering them.
    pub ring: bool,
}

impl Context {
    /// The group of `device` for `stage` of `plan`, if the plan is context-parallel: the
    /// `cp` consecutive replicas it is one of (their tensor-parallel ranks of the same rank).
    pub fn of(plan: &Plan, stage: StageId, device: DeviceId, exchanger: &Exchanger) -> Option<Context> {
        let cp = plan.training.context_parallel;
        if cp <= 1 {
            return None;
        }
        let group = PeerGroup::sized(plan, stage, device, exchanger, cp, pipec_plan::PeerDim::Context)?;
        Some(Context { group, cp, ring: plan.schedule.cp_comm == pipec_plan::vocab::CpComm::Ring })
    }

    /// This member's positions of a sequence whose local part has `local` positions.
    pub fn positions(&self, local: usize) -> Vec<usize> {
        pipec_plan::plan::context_positions(local * self.cp, self.cp, self.group.position)
    }

    /// Where a [batch, seq, d] activation of this member sits in the whole microbatch's,
    /// for a dropout mask ([`crate::backend::dropout::DropMask`]): the whole's dimensions
    /// (every member's positions) and the indices held (this member's positions).
    pub fn sequence_cut(context: Option<&Context>, [b, s, d]: [usize; 3]) -> (Vec<usize>, Vec<Vec<usize>>) {
        let (seq, at) = context.map_or_else(|| (s, (0..s).collect()), |c| (s * c.cp, c.positions(s)));
        (vec![b, seq, d], vec![(0..b).collect(), at, (0..d).collect()])
    }

    /// Every member's positions, member after member.
    fn members_positions(&self, local: usize) -> Vec<Vec<usize>> {
        (0..self.cp).map(|c| pipec_plan::plan::context_positions(local * self.cp, self.cp, c)).collect()
    }

    /// The positions of the gathered keys, member after member.
    pub fn key_positions(&self, local: usize) -> Vec<usize> {
        self.members_positions(local).concat()
    }

    /// The ring of a sequence whose local part has `local` positions (`causal`: masked by
    /// true position, in a sliding `window` when it is not 0; `group_size` query heads per
    /// key/value head).
    pub fn ring(&self, local: usize, causal: bool, window: usize, group_size: usize) -> crate::backend::ring::Ring {
        let positions = self.members_positions(local);
        crate::backend::ring::Ring { group: self.group.clone(), positions, causal, window, group_size, dropout: None }
    }

    /// Every member's keys (or values) [batch, heads, local, dh] gathered into
    /// [batch, heads, cp · local, dh], member after member; the gradient of the result
    /// goes back to the members and is summed there.
    pub fn gather<B: Kernels>(&self, x: Tensor<B, 4>) -> Result<Tensor<B, 4>> {
        let [b, h, s, dh] = x.dims();
        // validation's forwards gather detached keys and values (`PeerGroup::tracked`)
        let x = if self.group.tracked { x } else { x.detach() };
        let n = b * h * s * dh;
        let row = x.reshape([1, n]);
        let copies = Tensor::cat(vec![row; self.cp], 0);
        let ex = Exchange {
            group: self.group.clone(),
            send: vec![1; self.cp],
            recv: vec![1; self.cp],
            what: None,
            op: pipec_plan::PassOp::AllGather,
        };
        let got = B::exchange(copies, &ex)?;
        Ok(got.reshape([self.cp, b, h, s, dh]).permute([1, 2, 0, 3, 4]).reshape([b, h, self.cp * s, dh]))
    }

    /// Every member's `values` (host values, outside autodiff: a mixture of experts'
    /// routing counts), member after member.
    pub fn all_gather_values(&self, values: Vec<f32>) -> Result<Vec<Vec<f32>>> {
        self.group.all_gather(values).map_err(ExecError::Transport)
    }

    /// A mixture of experts over the whole sequence from this member's chunks: every
    /// member's routing counts gathered, per (sample, chunk of the sequence, expert) — each
    /// member holds chunks `position` and 2·cp − 1 − `position`, the first half of its
    /// positions and the second — the capacity's drops and the balancing loss's fractions
    /// are those of the whole microbatch. `by_expert` holds this member's (token, choice)
    /// pairs per expert in its token order (sample-major, its positions in order) of
    /// `batch` sequences of `local` positions. Returns each expert's fraction of the whole
    /// microbatch's choices (before any capacity), and with `capacity` (the whole
    /// microbatch's, per expert) drops the pairs whose place among the expert's pairs of
    /// the whole microbatch (sample by sample, position by position) is past it.
    pub fn route_whole(
        &self,
        by_expert: &mut [Vec<(usize, usize)>],
        batch: usize,
        local: usize,
        capacity: Option<usize>,
    ) -> Result<Vec<f32>> {
        let experts = by_expert.len();
        let half = (local / 2).max(1);
        let chunks = 2 * self.cp;
        // this member's counts per (sample, its first or second chunk, expert)
        let mut mine = vec![0f32; batch * 2 * experts];
        for (e, pairs) in by_expert.iter().enumerate() {
            for &(token, _) in pairs.iter() {
                let (sample, at) = (token / local.max(1), token % local.max(1));
                mine[(sample * 2 + usize::from(at >= half)) * experts + e] += 1.0;
            }
        }
        let all = self.all_gather_values(mine)?;
        // the whole microbatch's counts per (sample, chunk of the sequence, expert)
        let mut whole = vec![0f32; batch * chunks * experts];
        for (q, counts) in all.iter().enumerate() {
            if counts.len() != batch * 2 * experts {
                return Err(ExecError::Plan("a context-parallel member routed another microbatch's tokens".into()));
            }
            for sample in 0..batch {
                for (j, chunk) in [q, chunks - 1 - q].into_iter().enumerate() {
                    for e in 0..experts {
                        whole[(sample * chunks + chunk) * experts + e] = counts[(sample * 2 + j) * experts + e];
                    }
                }
            }
        }
        let tokens = (batch * local * self.cp).max(1) as f32;
        let fractions: Vec<f32> =
            (0..experts).map(|e| (0..batch * chunks).map(|i| whole[i * experts + e]).sum::<f32>() / tokens).collect();
        if let Some(cap) = capacity {
            let (first, late) = (self.group.position, chunks - 1 - self.group.position);
            for (e, pairs) in by_expert.iter_mut().enumerate() {
                // the expert's pairs of the whole microbatch before (sample, chunk)
                let before = |sample: usize, chunk: usize| -> usize {
                    (0..sample * chunks + chunk).map(|i| whole[i * experts + e] as usize).sum()
                };
                let mut seen: std::collections::HashMap<(usize, usize), usize> = std::collections::HashMap::new();
                pairs.retain(|&(token, _)| {
                    let (sample, at) = (token / local.max(1), token % local.max(1));
                    let chunk = if at < half { first } else { late };
                    let k = seen.entry((sample, chunk)).or_insert(0);
                    let place = before(sample, chunk) + *k;
                    *k += 1;
                    place < cap
                });
            }
        }
        Ok(fractions)
    }

    /// Takes the failure an exchange inside a backward recorded, if any.
    pub fn take_failure(&self) -> Option<ExecError> {
        self.group.take_failure()
    }
}

/// Rows `positions` of every sequence of `values` ([batch · seq · width], row-major),
/// batch after batch: a member's share of a microbatch's tokens or targets.
pub fn take_positions<T: Copy>(values: &[T], batch: usize, positions: &[usize]) -> Result<Vec<T>> {
    let seq = values.len() / batch.max(1);
    if batch == 0 || !values.len().is_multiple_of(batch) || positions.iter().any(|&p| p >= seq) {
        return Err(ExecError::Data(format!(
            "cannot take positions of {} values in {batch} sequences for context parallelism",
            values.len()
        )));
    }
    Ok((0..batch).flat_map(|i| positions.iter().map(move |&p| values[i * seq + p])).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_member_takes_its_two_chunks_of_every_sequence() {
        // 2 sequences of 8, cp 2: chunks of 2; member 0 has chunks 0 and 3, member 1 chunks 1 and 2
        let v: Vec<i64> = (0..16).collect();
        assert_eq!(
            take_positions(&v, 2, &pipec_plan::plan::context_positions(8, 2, 0)).expect("positions"),
            vec![0, 1, 6, 7, 8, 9, 14, 15]
        );
        assert_eq!(
            take_positions(&v, 2, &pipec_plan::plan::context_positions(8, 2, 1)).expect("positions"),
            vec![2, 3, 4, 5, 10, 11, 12, 13]
        );
        assert!(take_positions(&v, 3, &[0]).is_err());
        assert!(take_positions(&v, 2, &[8]).is_err());
    }

    #[test]
    fn the_members_positions_tile_the_sequence_with_equal_causal_work() {
        for cp in 1..=4 {
            let seq = 8 * cp;
            let mut all: Vec<usize> = (0..cp).flat_map(|c| pipec_plan::plan::context_positions(seq, cp, c)).collect();
            // every member attends to as many (query, earlier key) pairs as the others
            let work: Vec<usize> =
                (0..cp).map(|c| pipec_plan::plan::context_positions(seq, cp, c).iter().map(|p| p + 1).sum()).collect();
            assert!(work.windows(2).all(|w| w[0] == w[1]), "cp {cp}: {work:?}");
            all.sort_unstable();
            assert_eq!(all, (0..seq).collect::<Vec<_>>());
        }
    }
}
