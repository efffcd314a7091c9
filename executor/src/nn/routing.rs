//! Which experts a token of a mixture of experts chooses from its router's scores.

use pipec_plan::model::Moe;

use crate::error::{ExecError, Result};

/// Each token's `top_k` experts from the router's `scores` (a row of `moe.experts` per
/// token), token after token: by the scores, plus `bias` where the block has one
/// (`expert_bias`, for the choice only; empty: none).
pub(crate) fn choose_experts(scores: &[f32], bias: &[f32], moe: &Moe) -> Vec<usize> {
    let (experts, k) = (moe.experts, moe.top_k);
    let mut chosen = vec![0usize; scores.len() / experts.max(1) * k];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    let mut biased = Vec::with_capacity(experts);
    for (token, row) in scores.chunks_exact(experts.max(1)).enumerate() {
        let row = if bias.len() == experts {
            biased.clear();
            biased.extend(row.iter().zip(bias).map(|(s, b)| s + b));
            biased.as_slice()
        } else {
            row
        };
        choose(row, moe, &mut order, &mut chosen[token * k..(token + 1) * k]);
    }
    chosen
}

/// One token's experts from its router scores `row`, into `chosen` (`top_k` of them): the
/// best scores, the lower index first on a tie, among every expert — or, with group-limited
/// routing (`route_groups`), among the experts of the token's `route_group_top` best groups,
/// a group scored by the sum of its top_k / route_group_top best scores (Megatron-LM's
/// `group_limited_topk`; transformers' DeepSeek-V3 sums the two best, the same for its 8
/// choices from 4 groups). `order` is scratch space.
fn choose(row: &[f32], moe: &Moe, order: &mut Vec<usize>, chosen: &mut [usize]) {
    let experts = row.len();
    order.clear();
    if moe.groups > 1 && moe.group_top > 0 && experts.is_multiple_of(moe.groups) {
        let size = experts / moe.groups;
        let per = (chosen.len() / moe.group_top).max(1);
        let mut members = Vec::with_capacity(size);
        let mut scored: Vec<(f32, usize)> = Vec::with_capacity(moe.groups);
        for g in 0..moe.groups {
            members.clear();
            members.extend_from_slice(&row[g * size..(g + 1) * size]);
            members.sort_by(|a, b| b.total_cmp(a));
            scored.push((members.iter().take(per).sum(), g));
        }
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, g) in scored.iter().take(moe.group_top) {
            order.extend(g * size..(g + 1) * size);
        }
    } else {
        order.extend(0..experts);
    }
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let k = chosen.len().min(order.len());
    chosen[..k].copy_from_slice(&order[..k]);
}

/// Whole experts beside tensor parallelism (`etp: 1`): of each expert's (token, choice)
/// pairs of a microbatch's `t` tokens, which every rank of `(rank, tp)` routed alike, those
/// whose token is in this rank's run of the rows — rank r's `r·t/tp .. (r+1)·t/tp` — so that
/// the ranks of an expert group together send each pair once, and the block's all-reduce
/// of its MLP half sums the ranks' rows back into every token's.
pub(crate) fn rank_rows(
    by_expert: &[Vec<(usize, usize)>],
    t: usize,
    (rank, tp): (usize, usize),
) -> Result<Vec<Vec<(usize, usize)>>> {
    let tp = tp.max(1);
    if t < tp {
        return Err(ExecError::Shape(format!(
            "a microbatch of {t} tokens cannot give each of {tp} tensor-parallel ranks rows to send its whole experts"
        )));
    }
    let rows = rank * t / tp..(rank + 1) * t / tp;
    Ok(by_expert
        .iter()
        .map(|pairs| pairs.iter().copied().filter(|(token, _)| rows.contains(token)).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::model::Router;

    fn routing(top_k: usize, groups: usize, group_top: usize) -> Moe {
        Moe { router: Router::Sigmoid, groups, group_top, ..Moe::new(8, top_k) }
    }

    fn chosen(row: &[f32], moe: &Moe) -> Vec<usize> {
        let mut out = vec![0; moe.top_k];
        choose(row, moe, &mut Vec::new(), &mut out);
        out
    }

    #[test]
    fn group_limited_routing_chooses_among_the_best_groups_only() {
        // 4 groups of 2; with 4 choices from 2 groups each group is scored by its 2 best:
        // 1.0, 1.2, 0.8, 1.4 — groups 3 and 1, so experts 6, 7, 2, 3, where the 4 best of
        // all are 0, 4, 6, 7
        let row = [0.9, 0.1, 0.6, 0.6, 0.8, 0.0, 0.7, 0.7];
        assert_eq!(chosen(&row, &routing(4, 0, 0)), [0, 4, 6, 7]);
        assert_eq!(chosen(&row, &routing(4, 4, 2)), [6, 7, 2, 3]);
        // every group chosen, or one group of all: no limit
        assert_eq!(chosen(&row, &routing(4, 4, 4)), [0, 4, 6, 7]);
        assert_eq!(chosen(&row, &routing(4, 1, 1)), [0, 4, 6, 7]);
        // 2 choices from 1 group scored by its 2 best: group 3 (1.4)
        assert_eq!(chosen(&row, &routing(2, 4, 1)), [6, 7]);
    }

    /// Whole experts: the ranks' runs of rows split every expert's pairs between them, each
    /// pair on exactly one rank, in token order; fewer tokens than ranks is an error.
    #[test]
    fn each_pair_goes_out_from_exactly_one_rank() {
        // 5 tokens, top 2 of 3 experts
        let by_expert =
            vec![vec![(0, 0), (2, 1), (4, 0)], vec![(0, 1), (1, 0), (3, 1)], vec![(1, 1), (2, 0), (3, 0), (4, 1)]];
        let ranks: Vec<Vec<Vec<(usize, usize)>>> =
            (0..2).map(|r| rank_rows(&by_expert, 5, (r, 2)).expect("rows")).collect();
        // rank 0 sends tokens 0 and 1 (0..5/2), rank 1 tokens 2 to 4
        assert_eq!(ranks[0], vec![vec![(0, 0)], vec![(0, 1), (1, 0)], vec![(1, 1)]]);
        for (e, pairs) in by_expert.iter().enumerate() {
            let mut joined = ranks[0][e].clone();
            joined.extend(&ranks[1][e]);
            assert_eq!(&joined, pairs, "expert {e}");
        }
        assert!(rank_rows(&by_expert, 1, (0, 2)).is_err());
    }
}
