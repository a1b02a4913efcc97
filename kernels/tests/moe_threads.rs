//! The MoE FFN with a thread planner: every expert runs on the threads the planner gives it (rows
//! split into contiguous chunks); the forward is bit-identical to the one-thread path and the
//! backward equal up to the reordered sums of the weight gradients; the planner sees each block's
//! rows once in the forward and once in the backward.

use std::cell::RefCell;
use std::rc::Rc;

use troupe_kernels::Tensor;
use troupe_kernels::ops::{
    ExpertParams, moe_ffn_backward, moe_ffn_forward, top_k_route, with_expert_threads,
};

fn vals(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0) * scale).collect()
}

fn t(v: Vec<f32>, s: &[usize]) -> Tensor {
    Tensor::from_f32(s, v).expect("valid test input")
}

#[test]
fn planned_threads_change_nothing_but_who_computes() {
    let (tokens, d, h, e) = (40, 6, 10, 3);
    let experts: Vec<ExpertParams> = (0..e as u64)
        .map(|i| ExpertParams {
            w1: t(vals(10 + i, d * h, 0.7), &[d, h]),
            b1: t(vals(20 + i, h, 0.2), &[h]),
            w2: t(vals(30 + i, h * d, 0.7), &[h, d]),
            b2: t(vals(40 + i, d, 0.2), &[d]),
        })
        .collect();
    let x = t(vals(1, tokens * d, 1.0), &[tokens, d]);
    let routing = top_k_route(&t(vals(2, tokens * e, 2.0), &[tokens, e]), 2, 30).unwrap();
    let dy = t(vals(3, tokens * d, 1.0), &[tokens, d]);
    let (y1, c1) = moe_ffn_forward(&x, &routing, &experts).unwrap();
    let g1 = moe_ffn_backward(&dy, &c1, &experts).unwrap();
    let seen: Rc<RefCell<Vec<Vec<usize>>>> = Rc::default();
    let log = Rc::clone(&seen);
    // 3, 1 and 4 threads (4 > the rows of no expert here; 0 rows would get 0).
    let planner = Rc::new(move |rows: &[usize]| {
        log.borrow_mut().push(rows.to_vec());
        vec![3, 1, 4]
    });
    let (y2, g2) = with_expert_threads(planner, || {
        let (y, c) = moe_ffn_forward(&x, &routing, &experts).unwrap();
        (y, moe_ffn_backward(&dy, &c, &experts).unwrap())
    });
    assert_eq!(y1.to_vec_f32(), y2.to_vec_f32(), "forward rows are computed the same way");
    assert_eq!(g1.dx.to_vec_f32(), g2.dx.to_vec_f32());
    for (a, b) in g1.experts.iter().zip(&g2.experts) {
        for (p, q) in [(&a.w1, &b.w1), (&a.b1, &b.b1), (&a.w2, &b.w2), (&a.b2, &b.b2)] {
            for (u, v) in p.to_vec_f32().iter().zip(q.to_vec_f32()) {
                assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{u} vs {v}");
            }
        }
    }
    let rows: Vec<usize> = routing.experts.iter().map(Vec::len).collect();
    assert_eq!(*seen.borrow(), vec![rows.clone(), rows]);
    // Outside the closure the planner is gone.
    moe_ffn_forward(&x, &routing, &experts).unwrap();
    assert_eq!(seen.borrow().len(), 2);
}

#[test]
fn a_planner_with_the_wrong_arity_is_refused() {
    let experts = vec![
        ExpertParams {
            w1: t(vals(1, 8, 0.5), &[2, 4]),
            b1: t(vec![0.0; 4], &[4]),
            w2: t(vals(2, 8, 0.5), &[4, 2]),
            b2: t(vec![0.0; 2], &[2]),
        };
        2
    ];
    let x = t(vals(3, 8, 1.0), &[4, 2]);
    let routing = top_k_route(&t(vals(4, 8, 1.0), &[4, 2]), 1, 4).unwrap();
    let r = with_expert_threads(Rc::new(|_: &[usize]| vec![1]), || moe_ffn_forward(&x, &routing, &experts));
    assert!(r.is_err());
}
