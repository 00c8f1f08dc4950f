//! The vector arithmetic of the kernel, written so that the compiler vectorises it.

const LANES: usize = 8;

/// `<a, b>` with `LANES` independent partial sums, so the compiler can vectorise it.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut partial = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..LANES {
            partial[lane] += x[lane] * y[lane];
        }
    }
    partial.iter().sum::<f32>() + tail
}

/// `sum(xs)` with `LANES` independent partial sums.
#[inline(always)]
pub(super) fn sum(xs: &[f32]) -> f32 {
    let mut partial = [0.0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for x in chunks {
        for lane in 0..LANES {
            partial[lane] += x[lane];
        }
    }
    partial.iter().sum::<f32>() + tail
}

/// `acc += w * v`.
#[inline(always)]
pub(super) fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// `exp` of every element, in place: Cephes' `expf` (range reduction by `ln 2`, a
/// degree-7 polynomial), branch-free so that it vectorises; within 2 ulp of `f32::exp`
/// on `[-87, 88]`. Inputs below `-87.3` give about `1e-38` rather than 0 (a weight that
/// small is lost in any sum with a weight of 1), NaN stays NaN.
#[inline(always)]
pub fn exp_in_place(xs: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    for x in xs {
        // clamp keeps NaN.
        let v = x.clamp(-87.3, 88.3);
        let n = (v * LOG2E + ROUND) - ROUND;
        let r = v - n * LN2_HI - n * LN2_LO;
        let mut p = P[0];
        for c in &P[1..] {
            p = p * r + c;
        }
        let poly = p * r * r + r + 1.0;
        // 2^n for n in [-126, 127]: the exponent field.
        let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
        *x = poly * scale;
    }
}
