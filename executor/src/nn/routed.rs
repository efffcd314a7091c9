//! A mixture of experts' routed experts over an expert-parallel group: the tokens' rows sent
//! to the members computing their experts and back ([`Block::routed_over_group`]); beside
//! tensor parallelism with whole experts (`etp: 1`), each rank's run of the rows.

use burn::prelude::*;
use burn::tensor::IndexingUpdateOp;

use crate::backend::kernels::Kernels;
use crate::error::{ExecError, Result};
use crate::nn::block::Block;
use crate::nn::routing::rank_rows;

impl<B: Kernels> Block<B> {
    /// Expert parallelism: the routed experts' outputs, weighted, at their tokens — each
    /// pair's input sent to the member of `group` computing its expert (this member's
    /// experts computed on the rows every member sent), and the outputs sent back. The
    /// members first tell each other how many rows of each expert they send.
    pub(crate) fn routed_over_group(
        &self,
        x: &Tensor<B, 2>,
        weights: &Tensor<B, 1>,
        by_expert: &[Vec<(usize, usize)>],
        k: usize,
        group: &crate::backend::port::PeerGroup,
    ) -> Result<Tensor<B, 2>> {
        let [t, d] = x.dims();
        let dev = x.device();
        // whole experts (`etp: 1`): this rank sends its run of the rows only
        let mine;
        let by_expert = if self.whole_experts {
            mine = rank_rows(by_expert, t, self.tensor_parallel)?;
            mine.as_slice()
        } else {
            by_expert
        };
        let (ep, experts) = (group.members.len(), by_expert.len());
        let local = experts / ep.max(1);
        if local == 0 || local * ep != experts {
            return Err(ExecError::Plan(format!("{experts} experts do not divide over {ep} expert-parallel members")));
        }
        let ints = |v: Vec<usize>| {
            let n = v.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v.into_iter().map(|i| i as i64).collect(), [n]), &dev)
        };
        let rows_of = |e: usize| by_expert[e].len();
        let send: Vec<usize> = (0..ep).map(|j| (j * local..(j + 1) * local).map(rows_of).sum()).collect();
        let counts: Vec<Vec<f32>> =
            (0..ep).map(|j| (j * local..(j + 1) * local).map(|e| rows_of(e) as f32).collect()).collect();
        let got = group.exchange(pipec_plan::PassOp::AllToAll, counts).map_err(ExecError::Transport)?;
        // from each member, the rows it sends each of this member's experts
        let from: Vec<Vec<usize>> = got.iter().map(|c| c.iter().map(|&v| v as usize).collect()).collect();
        if from.iter().any(|c| c.len() != local) {
            return Err(crate::backend::port::mismatch(
                "the expert group's members disagree on the experts each holds".into(),
            ));
        }
        let recv: Vec<usize> = from.iter().map(|c| c.iter().sum()).collect();
        // this member's pairs in expert order: member-major, as `send` counts them
        let pairs: Vec<(usize, usize)> = by_expert.iter().flatten().copied().collect();
        if pairs.is_empty() {
            return Err(ExecError::Shape("a microbatch routed no token to any expert".into()));
        }
        let tokens = ints(pairs.iter().map(|&(token, _)| token).collect());
        let layer = self.index as u32;
        let ex = crate::backend::port::Exchange {
            group: group.clone(),
            send,
            recv: recv.clone(),
            what: Some((layer, pipec_plan::TokenExchange::Dispatch)),
            op: pipec_plan::PassOp::AllToAll,
        };
        let x = if group.tracked { x.clone() } else { x.clone().detach() };
        let arrived = B::exchange(x.select(0, tokens.clone()), &ex)?;
        // this member's experts, each on its rows from every member (member-major there)
        let n_recv: usize = recv.iter().sum();
        let computed = if n_recv == 0 {
            arrived
        } else {
            let starts: Vec<usize> = recv.iter().scan(0, |s, &n| Some(std::mem::replace(s, *s + n))).collect();
            let (mut outputs, mut order) = (Vec::new(), Vec::with_capacity(n_recv));
            for l in 0..local {
                let rows: Vec<usize> = (0..ep)
                    .flat_map(|i| {
                        let start = starts[i] + from[i][..l].iter().sum::<usize>();
                        start..start + from[i][l]
                    })
                    .collect();
                if rows.is_empty() {
                    continue;
                }
                order.extend_from_slice(&rows);
                let m = &self.mlps[group.position * local + l];
                outputs.push(self.mlp_of(m, arrived.clone().select(0, ints(rows)), self.whole_experts));
            }
            // back into the order the rows arrived in
            let mut inverse = vec![0usize; n_recv];
            for (at, &row) in order.iter().enumerate() {
                inverse[row] = at;
            }
            Tensor::cat(outputs, 0).select(0, ints(inverse))
        };
        let computed = if group.tracked { computed } else { computed.detach() };
        let combine =
            crate::backend::port::Exchange { what: Some((layer, pipec_plan::TokenExchange::Combine)), ..ex.reversed() };
        let returned = B::exchange(computed, &combine)?;
        let slots = ints(pairs.iter().map(|&(token, j)| token * k + j).collect());
        let w = weights.clone().select(0, slots).reshape([pairs.len(), 1]);
        Ok(Tensor::<B, 2>::zeros([t, d], &dev).select_assign(0, tokens, returned * w, IndexingUpdateOp::Add))
    }
}
