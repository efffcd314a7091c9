use super::*;

/// The layout round-trips: the chunks of every replica, gathered, are the whole values;
/// a reduce-scatter's input puts each replica's chunks (and the statistics) in its
/// segment; uneven lengths are padded with zeros.
#[test]
fn segments_cut_and_join_every_parameter() {
    let params = vec![(1, vec![2, 3]), (2, vec![5]), (3, vec![1])];
    let whole: Vec<Vec<f32>> =
        vec![(0..6).map(|x| x as f32).collect(), (10..15).map(|x| x as f32).collect(), vec![20.0]];
    for d in 1..=4 {
        let layouts: Vec<ShardLayout> = (0..d).map(|r| ShardLayout::new(&params, d, r)).collect();
        let l = &layouts[0];
        assert_eq!(l.segment, 6usize.div_ceil(d) + 5usize.div_ceil(d) + 1);
        let mut gathered = Vec::new();
        for r in 0..d {
            for (k, w) in whole.iter().enumerate() {
                gathered.extend(l.chunk(k, w, r));
            }
        }
        assert_eq!(l.whole(&[gathered]).expect("whole"), whole, "d = {d}");
        let mut input = l.scatter_input(&whole.iter().cloned().map(Some).collect::<Vec<_>>(), &[7.0, 8.0]);
        assert_eq!(input.len(), 1);
        let input = input.remove(0);
        assert_eq!(input.len(), d * (l.segment + 2));
        for (r, layout) in layouts.iter().enumerate() {
            let seg = &input[r * (l.segment + 2)..(r + 1) * (l.segment + 2)];
            let (chunks, stats) = layout.split_segment(seg).expect("split");
            assert_eq!(stats, &[7.0, 8.0]);
            for (k, (c, w)) in chunks.iter().zip(&whole).enumerate() {
                assert_eq!(*c, l.chunk(k, w, r).as_slice(), "d = {d}, replica {r}, parameter {k}");
            }
        }
    }
    // a missing gradient is zeros
    let l = ShardLayout::new(&params, 2, 0);
    assert!(l.scatter_input(&[None, None, None], &[]).concat().iter().all(|x| *x == 0.0));
}

/// Under expert parallelism a layout has two parts — the dense parameters over the
/// stage's 4 replicas, this member's experts over its 2 holders — and a parameter of
/// neither (another position's expert) has no chunk: each part's reduce-scatter input
/// and all-gather round-trip on its own, and a segment is part 0's chunks, part 1's,
/// then the statistics.
#[test]
fn an_expert_parallel_layout_shards_each_part_over_its_own_replicas() {
    let params: Vec<(u64, Vec<usize>)> = vec![(1, vec![2, 3]), (2, vec![5]), (3, vec![4]), (4, vec![3])];
    let part_of = |k: usize| [Some(0), Some(1), None, Some(0)][k];
    let whole: Vec<Vec<f32>> = params
        .iter()
        .map(|(id, shape)| (0..shape.iter().product::<usize>()).map(|x| (10 * *id as usize + x) as f32).collect())
        .collect();
    let layout = |r0: usize, r1: usize| {
        ShardLayout::split(&params, &[ShardPart { d: 4, rank: r0 }, ShardPart { d: 2, rank: r1 }], part_of)
    };
    let l = layout(0, 0);
    assert_eq!(l.params.iter().map(|p| p.chunk).collect::<Vec<_>>(), vec![2, 3, 0, 1]);
    assert_eq!((l.part_segment(0), l.part_segment(1), l.segment), (3, 3, 6));
    // each part's all-gather of its replicas' chunks gives its parameters whole
    let gather = |i: usize, d: usize| -> Vec<f32> {
        (0..d)
            .flat_map(|r| {
                (0..4).filter(|&k| part_of(k) == Some(i)).flat_map(|k| l.chunk(k, &whole[k], r)).collect::<Vec<_>>()
            })
            .collect()
    };
    let got = l.whole(&[gather(0, 4), gather(1, 2)]).expect("whole");
    assert_eq!(got, vec![whole[0].clone(), whole[1].clone(), Vec::new(), whole[3].clone()]);
    // the reduce-scatter inputs: part 0 with the statistics, part 1 without
    let inputs = l.scatter_input(&whole.iter().cloned().map(Some).collect::<Vec<_>>(), &[7.0]);
    assert_eq!((inputs[0].len(), inputs[1].len()), (4 * (3 + 1), 2 * 3));
    let (r0, r1) = (2, 1);
    let mine = layout(r0, r1);
    let results = vec![inputs[0][r0 * 4..r0 * 4 + 4].to_vec(), inputs[1][r1 * 3..r1 * 3 + 3].to_vec()];
    let segment = mine.joined_segment(results, 1).expect("joined");
    let (chunks, stats) = mine.split_segment(&segment).expect("split");
    assert_eq!(stats, &[7.0]);
    for k in 0..4 {
        let expected = if part_of(k).is_none() { Vec::new() } else { mine.chunk(k, &whole[k], mine.rank_of(k)) };
        assert_eq!(chunks[k], expected.as_slice(), "parameter {k}");
    }
    assert_eq!(mine.segment_of(&chunks.iter().map(|c| c.to_vec()).collect::<Vec<_>>(), &[7.0]), segment);
    assert_eq!(mine.part_inputs(|k| Ok(chunks[k].to_vec()), |_| true).expect("inputs").len(), 2);
}
