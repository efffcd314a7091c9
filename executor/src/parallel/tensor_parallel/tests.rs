use super::*;

#[test]
fn shards_join_back_into_the_whole_tensor_for_every_split_and_degree() {
    for tp in [1usize, 2, 4] {
        let cases = [
            (Sharding::Whole, 24),
            (Sharding::Columns { rows: 3, cols: 8 }, 24),
            (Sharding::Columns { rows: 1, cols: 8 }, 8),
            (Sharding::Rows, 24),
            (Sharding::Parts { rows: 2, widths: [4, 4, 4] }, 24),
            (Sharding::Parts { rows: 1, widths: [4, 4, 4] }, 12),
            (Sharding::Parts { rows: 2, widths: [8, 4, 4] }, 32),
            (Sharding::Parts { rows: 1, widths: [4, 4, 0] }, 8),
        ];
        for (s, n) in cases {
            let full: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let parts: Vec<Vec<f32>> = (0..tp).map(|r| shard(&full, s, tp, r)).collect();
            if s != Sharding::Whole {
                assert!(parts.iter().all(|p| p.len() == n / tp), "{s:?} tp {tp}");
            }
            assert_eq!(unshard(&parts, s).expect("joins"), full, "{s:?} tp {tp}");
        }
    }
    // a QKV projection keeps each rank's query, key and value columns together:
    // [q0 q1 | k0 k1 | v0 v1] over 2 ranks is [q0 k0 v0] and [q1 k1 v1]
    let qkv = [1.0, 2.0, 10.0, 20.0, 100.0, 200.0];
    assert_eq!(shard(&qkv, Sharding::Parts { rows: 1, widths: [2, 2, 2] }, 2, 1), vec![2.0, 20.0, 200.0]);
    assert!(unshard(&[vec![1.0], vec![1.0, 2.0]], Sharding::Rows).is_err());
}

/// The vocabulary-parallel loss over 2 and 4 ranks equals the one-device cross-entropy,
/// and each rank's score gradient is its columns of the one-device gradient.
#[test]
fn the_vocabulary_parallel_loss_is_the_cross_entropy_and_its_gradient() {
    use crate::backend::CpuBackend as B;
    use std::sync::{Arc, Barrier, Mutex};
    let (rows, vocab) = (6usize, 8usize);
    let scores: Vec<f32> = (0..rows * vocab).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7).collect();
    // targets in every rank's part, the first and the last column included
    let classes: Vec<i64> = vec![0, 7, 3, 4, 5, 2];
    let dev = Default::default();
    let whole = Tensor::<B, 2>::from_data(TensorData::new(scores.clone(), [rows, vocab]), &dev).require_grad();
    let labels = Tensor::<B, 2, Int>::from_data(TensorData::new(classes.clone(), [rows, 1]), &dev);
    let reference = burn::tensor::activation::log_softmax(whole.clone(), 1).gather(1, labels).mean().neg();
    let grads = reference.backward();
    let expected_grad = host_f32(whole.grad(&grads).expect("gradient").into_data()).expect("host");
    let expected = host_f32(reference.into_data()).expect("host")[0];
    for tp in [2usize, 4] {
        let part = vocab / tp;
        let barrier = Arc::new(Barrier::new(tp));
        let inbox: Arc<Mutex<Vec<Vec<f32>>>> = Arc::new(Mutex::new(Vec::new()));
        let outbox: Arc<Mutex<Vec<f32>>> = Arc::new(Mutex::new(Vec::new()));
        let handles: Vec<_> = (0..tp)
            .map(|rank| {
                let (barrier, inbox, outbox) = (barrier.clone(), inbox.clone(), outbox.clone());
                let (scores, classes) = (scores.clone(), classes.clone());
                std::thread::spawn(move || {
                    // an all-reduce by hand: every rank posts, one sums, all read
                    let mut reduce = |v: Vec<f32>| -> Result<Vec<f32>> {
                        inbox.lock().expect("lock").push(v);
                        if barrier.wait().is_leader() {
                            let posted = std::mem::take(&mut *inbox.lock().expect("lock"));
                            let sum = posted.iter().fold(vec![0.0; posted[0].len()], |mut a, p| {
                                a.iter_mut().zip(p).for_each(|(x, y)| *x += y);
                                a
                            });
                            *outbox.lock().expect("lock") = sum;
                        }
                        barrier.wait();
                        let sum = outbox.lock().expect("lock").clone();
                        barrier.wait();
                        Ok(sum)
                    };
                    let dev = Default::default();
                    let mine = shard(&scores, Sharding::Columns { rows, cols: vocab }, tp, rank);
                    let local = Tensor::<B, 2>::from_data(TensorData::new(mine, [rows, part]), &dev).require_grad();
                    let loss =
                        vocab_parallel_loss(Act::D2(local.clone()), &classes, rank * part, rank, tp, &mut reduce)
                            .expect("loss");
                    let value = host_f32(loss.clone().into_data()).expect("host")[0];
                    let g = loss.backward();
                    (rank, value, host_f32(local.grad(&g).expect("gradient").into_data()).expect("host"))
                })
            })
            .collect();
        let mut parts = vec![Vec::new(); tp];
        for h in handles {
            let (rank, value, grad) = h.join().expect("rank");
            assert!((value - expected).abs() <= 1e-6 * expected.abs(), "tp {tp} rank {rank}: {value} vs {expected}");
            parts[rank] = grad;
        }
        let joined = unshard(&parts, Sharding::Columns { rows, cols: vocab }).expect("joins");
        for (a, b) in joined.iter().zip(&expected_grad) {
            assert!((a - b).abs() <= 1e-6, "tp {tp}: gradient {a} vs {b}");
        }
    }
}
