//! ggml's tensor types: their ids and block sizes, and the quantized ones this crate loads
//! repacked into MLX's affine form (`w = scale * q + bias` per group, unsigned `bits`-bit
//! codes packed `32 / bits` to a little-endian u32, value j of a word in bits
//! `[j * bits, (j + 1) * bits)`), which every backend's kernels read.
//!
//! Contract: for every supported block type, `scale * q + bias` computed in f32 (a multiply,
//! then an add) gives bit for bit the value llama.cpp's `dequantize_row_*` gives: each
//! product and each sum below is exact in f32 (the integer significands' bits are counted
//! at each type), so both round the same once, or not at all. Block layouts are those of
//! ggml's `ggml-common.h` (`block_q4_0`, `block_q8_0`, `block_q4_K`, `block_q5_K`,
//! `block_q6_K`); the unpacking is written from the layouts, not copied.

/// ggml's `QK_K`: values in a K-quant super-block.
const QK_K: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    /// A type ggml defines that this loader does not: its name and (block, bytes).
    Other(&'static str, usize, usize),
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Other("Q4_1", 32, 20),
            6 => Other("Q5_0", 32, 22),
            7 => Other("Q5_1", 32, 24),
            8 => Q8_0,
            9 => Other("Q8_1", 32, 36),
            10 => Other("Q2_K", 256, 84),
            11 => Other("Q3_K", 256, 110),
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Other("Q8_K", 256, 292),
            16 => Other("IQ2_XXS", 256, 66),
            17 => Other("IQ2_XS", 256, 74),
            18 => Other("IQ3_XXS", 256, 98),
            19 => Other("IQ1_S", 256, 50),
            20 => Other("IQ4_NL", 32, 18),
            21 => Other("IQ3_S", 256, 110),
            22 => Other("IQ2_S", 256, 82),
            23 => Other("IQ4_XS", 256, 136),
            24 => Other("I8", 1, 1),
            25 => Other("I16", 1, 2),
            26 => Other("I32", 1, 4),
            27 => Other("I64", 1, 8),
            28 => Other("F64", 1, 8),
            29 => Other("IQ1_M", 256, 56),
            30 => Bf16,
            34 => Other("TQ1_0", 256, 54),
            35 => Other("TQ2_0", 256, 66),
            39 => Other("MXFP4", 32, 17),
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::Other(n, ..) => n,
        }
    }

    /// (values a block holds, bytes it takes).
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (QK_K, 144),
            GgmlType::Q5K => (QK_K, 176),
            GgmlType::Q6K => (QK_K, 210),
            GgmlType::Other(_, b, s) => (b, s),
        }
    }

    /// Bytes a tensor of `values` values in rows of `cols` takes; an error when a row is not
    /// whole blocks.
    pub fn bytes_for(self, cols: usize, values: usize) -> Result<usize, String> {
        let (block, size) = self.block();
        if !cols.is_multiple_of(block) {
            return Err(format!("its rows of {cols} values are not whole {} blocks of {block}", self.name()));
        }
        (values / block).checked_mul(size).ok_or_else(|| format!("{values} values overflow"))
    }

    /// The MLX layout a quantized type repacks into: (bits, group).
    pub fn mlx_layout(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::Q4_0 | GgmlType::Q4K => Some((4, 32)),
            GgmlType::Q8_0 | GgmlType::Q5K => Some((8, 32)),
            GgmlType::Q6K => Some((8, 16)),
            _ => None,
        }
    }
}

/// One tensor repacked: codes in MLX's packed order, one scale and bias per group.
pub struct Repacked {
    pub bits: usize,
    pub group: usize,
    /// `rows * cols * bits / 8` bytes.
    pub packed: Vec<u8>,
    /// `rows * cols / group` each.
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

fn f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// A K-quant's unpacking of sub-block `j`'s 6-bit (scale, min) from its 12 scale bytes.
pub type ScaleMin = fn(usize, &[u8]) -> (u8, u8);

/// Decodes one block into `codes` (unsigned, one per value) and its groups' `(scale,
/// bias)`s. The block has the type's size; `codes` its values.
fn decode_block(
    ty: GgmlType,
    b: &[u8],
    codes: &mut [u8],
    groups: &mut Vec<(f32, f32)>,
    scale_min_k4: ScaleMin,
) {
    match ty {
        // w = d * (q - 8): scale d, bias -8d (exact: d has 11 significant bits).
        GgmlType::Q4_0 => {
            let d = f16(b, 0);
            for (j, &q) in b[2..18].iter().enumerate() {
                codes[j] = q & 15;
                codes[j + 16] = q >> 4;
            }
            groups.push((d, -8.0 * d));
        }
        // w = d * q, q signed: code q + 128, bias -128d (d * code: 19 bits, exact).
        GgmlType::Q8_0 => {
            let d = f16(b, 0);
            for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
                *c = (q as i8 as i16 + 128) as u8;
            }
            groups.push((d, -128.0 * d));
        }
        // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: chunk j of 64
        // values takes bytes 32j.. (low nibbles: sub-block 2j, high: 2j + 1).
        // w = (d * sc) * q - dmin * m: d * sc has 17 bits, times a 4- or 5-bit q at most 22.
        GgmlType::Q4K | GgmlType::Q5K => {
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            let sc = &b[4..16];
            let (qs, qh) = match ty {
                GgmlType::Q4K => (&b[16..144], None),
                _ => (&b[48..176], Some(&b[16..48])),
            };
            for j in 0..4 {
                for half in 0..2 {
                    let s = 2 * j + half;
                    let (scale, min) = scale_min_k4(s, sc);
                    groups.push((d * scale as f32, -(dmin * min as f32)));
                    for l in 0..32 {
                        let mut q = (qs[32 * j + l] >> (4 * half)) & 15;
                        if let Some(qh) = qh {
                            q |= ((qh[l] >> s) & 1) << 4;
                        }
                        codes[64 * j + 32 * half + l] = q;
                    }
                }
            }
        }
        // 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d. In each
        // half of 128 values, value l + 32k (l < 32, k < 4) takes nibble k / 2 of byte
        // l + 32 (k % 2) and bits 2k.. of qh byte l; value v's group of 16 has scale
        // sc[v / 16]. w = (d * sc) * (q - 32): code q, scale d * sc (18 bits), bias -32 d sc;
        // d * sc * q is at most 24 bits, so exact.
        GgmlType::Q6K => {
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16(b, 208));
            for h in 0..2 {
                for l in 0..32 {
                    for k in 0..4 {
                        let lo = (ql[64 * h + l + 32 * (k % 2)] >> (4 * (k / 2))) & 15;
                        let hi = (qh[32 * h + l] >> (2 * k)) & 3;
                        codes[128 * h + l + 32 * k] = lo | (hi << 4);
                    }
                }
            }
            for &s in sc {
                let scale = d * (s as i8) as f32;
                groups.push((scale, -32.0 * scale));
            }
        }
        _ => unreachable!("decode_block is called for quantized types only"),
    }
}

/// Sub-block `j`'s 6-bit (scale, min) of a K-quant's 12 scale bytes: sub-blocks 0-3 in the
/// low 6 bits of bytes j and j + 4; 4-7 in the nibbles of byte j + 4 with their top two
/// bits in the high bits of bytes j - 4 and j.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Repacks a `rows x cols` tensor of quantized type `ty` (its bytes `data`, whole blocks
/// per row, which the reader checked).
pub fn repack(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Repacked {
    repack_with(ty, data, rows, cols, scale_min_k4)
}

/// [`repack`] with K-quant scales unpacked by `scale_min` (a test's negative control
/// passes a wrong one).
#[doc(hidden)]
pub fn repack_with(ty: GgmlType, data: &[u8], rows: usize, cols: usize, scale_min: ScaleMin) -> Repacked {
    use rayon::prelude::*;
    let (bits, group) = ty.mlx_layout().expect("repack is called for quantized types only");
    let (block, size) = ty.block();
    let (row_in, row_out, groups_row) = (cols / block * size, cols * bits / 8, cols / group);
    let mut packed = vec![0u8; rows * row_out];
    let mut sb = vec![(0f32, 0f32); rows * groups_row];
    packed.par_chunks_mut(row_out.max(1)).zip(sb.par_chunks_mut(groups_row.max(1))).enumerate().for_each(
        |(r, (out, sb))| {
            let mut codes = vec![0u8; block];
            let mut groups = Vec::with_capacity(block / group);
            for (bi, blk) in data[r * row_in..(r + 1) * row_in].chunks_exact(size).enumerate() {
                groups.clear();
                decode_block(ty, blk, &mut codes, &mut groups, scale_min);
                sb[bi * (block / group)..][..groups.len()].copy_from_slice(&groups);
                let o = &mut out[bi * block * bits / 8..][..block * bits / 8];
                if bits == 8 {
                    o.copy_from_slice(&codes);
                } else {
                    for (o, c) in o.iter_mut().zip(codes.chunks_exact(2)) {
                        *o = c[0] | (c[1] << 4);
                    }
                }
            }
        },
    );
    let (scales, biases) = sb.into_iter().unzip();
    Repacked { bits, group, packed, scales, biases }
}

/// The dequantized values of a repacked tensor (tests and references): `scale * q + bias`.
pub fn dequantize(r: &Repacked) -> Vec<f32> {
    let n = r.packed.len() * 8 / r.bits;
    (0..n)
        .map(|i| {
            let byte = r.packed[i * r.bits / 8];
            let q = if r.bits == 8 { byte } else { (byte >> (4 * (i % 2))) & 15 };
            let g = i / r.group;
            r.scales[g] * q as f32 + r.biases[g]
        })
        .collect()
}
