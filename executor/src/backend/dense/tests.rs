use super::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Distribution, TensorData};

use crate::backend::attention::MaskPositions;

type B = crate::backend::CpuBackend;

/// The causal mask of `s` queries over the same `s` keys.
fn causal_mask(s: usize) -> crate::backend::attention::Causal {
    let p: Vec<usize> = (0..s).collect();
    Some(std::sync::Arc::new(MaskPositions { queries: p.clone(), keys: p, window: 0 }))
}

/// Attention's core recomputed in the backward gives the values and the q, k, v
/// gradients of the core kept (Burn's own autodiff through the same forward), causal or
/// not, with sinks or not, with the probabilities' dropout or not (the kept core
/// multiplies by the mask's factors in Burn's operations; the recomputed one draws the
/// mask again), to 1e-5 of the largest value, and passes a gradient to what is tracked.
#[test]
fn the_attention_core_recomputed_in_the_backward_has_the_kept_cores_gradients() {
    let dev = Default::default();
    let rand = |seed: u64| {
        <B as Backend>::seed(&dev, seed);
        Tensor::<B, 4>::random([2, 3, 5, 4], Distribution::Normal(0.0, 1.0), &dev)
    };
    let close = |a: TensorData, b: TensorData, what: &str| {
        let (a, b) = (a.to_vec::<f32>().expect("f32"), b.to_vec::<f32>().expect("f32"));
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5 * scale, "{what}: differs by {worst} (largest value {scale})");
    };
    // no mask, the causal one, a context-parallel member's: queries at positions 1, 2, 7,
    // 8, 9 of a sequence against keys in another order, and that in a sliding window of 4
    let member = |window| {
        Some(std::sync::Arc::new(MaskPositions { queries: vec![1, 2, 7, 8, 9], keys: vec![5, 0, 9, 3, 1], window }))
    };
    // and each with sinks (a logit per head of the 3, of both signs)
    let with_sinks = [None, Some(vec![0.5f32, -1.0, 2.0])];
    // and each with dropout: a third of the probabilities of heads 1..4 of 5 and positions
    // 2..7 of 8 dropped
    let picks = vec![vec![0, 1], vec![1, 2, 3], vec![2, 3, 4, 5, 6], vec![3, 4, 5, 6, 7]];
    let dropout = crate::backend::dropout::DropMask::new(1.0 / 3.0, &[7], vec![2, 5, 8, 8], picks);
    let with_dropout = [None, Some(std::sync::Arc::new(dropout))];
    for ((causal, sinks), drop) in [None, causal_mask(5), member(0), member(4)]
        .into_iter()
        .flat_map(|c| with_sinks.iter().map(move |s| (c.clone(), s.clone())))
        .flat_map(|cs| with_dropout.iter().map(move |d| (cs.clone(), d.clone())))
    {
        let weights = rand(9);
        let run = |recomputed: bool| {
            let (q, k, v) = (rand(1).require_grad(), rand(2).require_grad(), rand(3).require_grad());
            let s = sinks.clone().map(|s| Tensor::<B, 1>::from_data(TensorData::new(s, [3]), &dev).require_grad());
            let out = if recomputed {
                B::attention_recomputed(q.clone(), k.clone(), v.clone(), 4, causal.clone(), s.clone(), &drop)
            } else {
                let mask = causal.as_ref().map(|m| m.mask());
                let p = attention_weights(q.clone(), k.clone(), 4, mask, s.clone());
                let p = match &drop {
                    Some(d) => p * d.tensor::<B>(&dev).reshape([2, 3, 5, 5]),
                    None => p,
                };
                p.matmul(v.clone())
            };
            let grads = (out.clone() * weights.clone()).sum().backward();
            let g = |t: &Tensor<B, 4>| t.grad(&grads).expect("a gradient").into_data();
            let ds = s.map(|s| s.grad(&grads).expect("the sinks' gradient").into_data());
            (out.into_data(), g(&q), g(&k), g(&v), ds)
        };
        let (kept, recomputed) = (run(false), run(true));
        close(kept.0, recomputed.0, "the forward");
        close(kept.1, recomputed.1, "dq");
        close(kept.2, recomputed.2, "dk");
        close(kept.3, recomputed.3, "dv");
        if let (Some(a), Some(b)) = (kept.4, recomputed.4) {
            close(a, b, "the sinks' gradient");
        }
    }
    // only v tracked: v gets its gradient, and nothing is asked of q and k
    let v = rand(3).require_grad();
    let out = B::attention_recomputed(rand(1), rand(2), v.clone(), 4, causal_mask(5), None, &None);
    let grads = out.sum().backward();
    assert!(v.grad(&grads).is_some());
}

/// Dropout whose backward draws its mask again has Burn's gradient of the product with the
/// mask's factors, and drops about p of the values.
#[test]
fn dropout_drawn_again_in_the_backward_has_the_kept_masks_gradient() {
    let dev = Default::default();
    let x = random([6, 50], 4).reshape([300]).require_grad();
    let mask = std::sync::Arc::new(crate::backend::dropout::DropMask::whole(0.3, &[1, 2], vec![6, 50]));
    let w = random([6, 50], 5).reshape([300]);
    let ours = (B::dropout(x.clone(), mask.clone()) * w.clone()).sum().backward();
    let burns = (x.clone() * mask.tensor::<B>(&dev) * w).sum().backward();
    let g = |grads| x.grad(&grads).expect("a gradient").into_data();
    let (a, b) = (g(ours), g(burns));
    assert_eq!(a, b);
    let dropped = a.to_vec::<f32>().expect("f32").iter().filter(|&&v| v == 0.0).count();
    assert!((60..120).contains(&dropped), "{dropped} of 300 dropped at p = 0.3");
}

fn random(shape: [usize; 2], seed: u64) -> Tensor<B, 2> {
    <B as Backend>::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

fn data(t: Tensor<<B as AutodiffBackend>::InnerBackend, 2>) -> TensorData {
    t.into_data()
}

/// Equal up to float rounding: the two products may sum in different orders.
fn close(a: TensorData, b: TensorData, what: &str) {
    assert_eq!(a.shape, b.shape, "{what}");
    let (a, b) = (a.to_vec::<f32>().expect("f32"), b.to_vec::<f32>().expect("f32"));
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * scale, "{what}: element {i}: {x} against {y}");
    }
}

/// Two layers, so the first one's output gradient comes through the second one's input
/// gradient; the gradients must be Burn's own.
fn grads(x: &Tensor<B, 2>, w1: &Tensor<B, 2>, w2: &Tensor<B, 2>, ours: bool) -> (TensorData, TensorData, TensorData) {
    let mm = |a: Tensor<B, 2>, b: Tensor<B, 2>| if ours { B::dense(a, b) } else { a.matmul(b) };
    let h = burn::tensor::activation::relu(mm(x.clone(), w1.clone()));
    let g = mm(h, w2.clone()).sum().backward();
    (
        data(x.grad(&g).expect("a gradient")),
        data(w1.grad(&g).expect("a gradient")),
        data(w2.grad(&g).expect("a gradient")),
    )
}

#[test]
fn gradients_equal_burns_matmul() {
    for rows in [1, 5, 32] {
        let x = random([rows, 48], 1).require_grad();
        let w1 = random([48, 40], 2).require_grad();
        let w2 = random([40, 7], 3).require_grad();
        let (dx, dw1, dw2) = grads(&x, &w1, &w2, true);
        let (rx, rw1, rw2) = grads(&x, &w1, &w2, false);
        close(dx, rx, &format!("{rows} rows: input gradient"));
        close(dw1, rw1, &format!("{rows} rows: first weight gradient"));
        close(dw2, rw2, &format!("{rows} rows: second weight gradient"));
    }
    // the benchmark model's shape (the kernel's packed path), and a tall weight
    for (rows, inner) in [(32, 1024), (7, 300)] {
        let x = random([rows, inner], 4).require_grad();
        let w1 = random([inner, 1024], 5).require_grad();
        let w2 = random([1024, 10], 6).require_grad();
        let (dx, dw1, dw2) = grads(&x, &w1, &w2, true);
        let (rx, rw1, rw2) = grads(&x, &w1, &w2, false);
        close(dx, rx, &format!("{rows} × {inner}: input gradient"));
        close(dw1, rw1, &format!("{rows} × {inner}: first weight gradient"));
        close(dw2, rw2, &format!("{rows} × {inner}: second weight gradient"));
    }
}

#[test]
fn untracked_input_or_weight() {
    // an input without a gradient (the data), and a frozen weight
    let x = random([4, 6], 4);
    let w = random([6, 3], 5).require_grad();
    let g = B::dense(x.clone(), w.clone()).sum().backward();
    let g_ref = x.clone().matmul(w.clone()).sum().backward();
    close(data(w.grad(&g).expect("a gradient")), data(w.grad(&g_ref).expect("a gradient")), "weight gradient");
    assert!(x.grad(&g).is_none());
    let x = x.require_grad();
    let frozen = random([6, 3], 6);
    let g = B::dense(x.clone(), frozen.clone()).sum().backward();
    let g_ref = x.clone().matmul(frozen.clone()).sum().backward();
    close(data(x.grad(&g).expect("a gradient")), data(x.grad(&g_ref).expect("a gradient")), "input gradient");
    // no autodiff at all: the plain product
    let y = <B as AutodiffBackend>::InnerBackend::dense(x.clone().inner(), frozen.clone().inner());
    assert_eq!(data(y), data(x.inner().matmul(frozen.inner())));
}

#[test]
fn on_flex_the_input_gradient_reads_the_weight_as_it_lies() {
    // (w · dyᵀ)ᵀ: a transposed view of a product, not Burn's dy · wᵀ
    let dy = random([32, 64], 12).inner().into_primitive().tensor();
    let w = random([48, 64], 13).inner().into_primitive().tensor();
    let ours = <burn::backend::Flex as Kernels>::input_grad(dy.clone(), w.clone());
    assert!(!ours.is_contiguous(), "the product is taken transposed and not copied");
    let burns = <burn::backend::Flex as FloatTensorOps<_>>::float_matmul(
        dy,
        <burn::backend::Flex as FloatTensorOps<_>>::float_transpose(w),
    );
    let as_data = |t| Tensor::<burn::backend::Flex, 2>::from_primitive(TensorPrimitive::Float(t)).into_data();
    close(as_data(ours), as_data(burns), "input gradient");
}

/// A step that blocks a backward until the test releases it.
#[derive(Debug)]
struct Held;

/// (entered the backward, released by the test, gave up waiting)
type Gate = std::sync::Arc<(std::sync::Mutex<(bool, bool, bool)>, std::sync::Condvar)>;

impl<I: Backend> Backward<I, 1> for Held {
    type State = Gate;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (lock, cvar) = &*ops.state;
        let mut state = lock.lock().expect("gate");
        state.0 = true; // entered
        cvar.notify_all();
        let (mut state, _) =
            cvar.wait_timeout_while(state, std::time::Duration::from_secs(20), |s| !s.1).expect("gate");
        state.2 = !state.1;
        drop(state);
        burn::backend::autodiff::ops::unary::<I, _>(ops.parents, ops.node, grads, |g| g);
    }
}

/// One device's backward must not wait for another device's backward to end (the sweep
/// at the end of every backward skips busy graphs: vendor/burn-autodiff's fix).
#[test]
fn a_backward_does_not_wait_for_another_threads_backward() {
    let gate: Gate = Default::default();
    let held = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            let x = random([2, 3], 14).require_grad().into_primitive().tensor();
            let y = match Held
                .prepare::<burn::backend::autodiff::checkpoint::strategy::NoCheckpointing>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(gate, x.primitive),
                OpsKind::UnTracked(prep) => prep.finish(x.primitive),
            };
            drop(Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).sum().backward());
        })
    };
    let (lock, cvar) = &*gate;
    let state = cvar.wait_while(lock.lock().expect("gate"), |s| !s.0).expect("gate");
    drop(state);
    // the other thread is inside its backward, holding its graph: this one must finish
    let z = random([2, 2], 15).require_grad();
    let g = B::dense(z.clone(), random([2, 2], 16)).sum().backward();
    assert!(z.grad(&g).is_some());
    {
        let mut state = lock.lock().expect("gate");
        state.1 = true;
        cvar.notify_all();
    }
    held.join().expect("the held backward finishes");
    let gave_up = lock.lock().expect("gate").2;
    assert!(!gave_up, "this backward waited for the other thread's backward to end");
}
