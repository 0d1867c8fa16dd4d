//! The hash of an encoded key ([`super::KeyTable`]'s index), in one call, and the
//! equality of short byte strings.
//!
//! The same folded multiplications as foldhash's, with randomly drawn seeds, but for one
//! byte string at once: `BuildHasher::hash_one` on a `&[u8]` writes a length prefix into
//! a 128-bit sponge, then the bytes, then folds the sponge: about 57 instructions for a
//! key of 17 to 32 bytes (a product and a market), against about 33 here.

/// Seeds of the key hash, drawn once per table.
#[derive(Clone, Copy)]
pub(crate) struct KeyHasher {
    seed: u64,
    expand: u64,
    fold: u64,
}

impl Default for KeyHasher {
    /// Seeds drawn from a fresh foldhash random state (a per-process seed mixed with one
    /// of this instance's), so a crafted input cannot aim its keys at one bucket of a run
    /// it did not see.
    fn default() -> Self {
        use std::hash::BuildHasher;
        let random = foldhash::fast::RandomState::default();
        KeyHasher {
            seed: random.hash_one(1u64),
            expand: random.hash_one(2u64),
            fold: random.hash_one(3u64) | 1,
        }
    }
}

/// The product of `x` and `y`, its high half folded into its low half.
#[inline(always)]
fn folded_multiply(x: u64, y: u64) -> u64 {
    let full = u128::from(x) * u128::from(y);
    (full as u64) ^ ((full >> 64) as u64)
}

/// The 8 bytes at `at`, which lie within `b`.
#[inline(always)]
fn word(b: &[u8], at: usize) -> u64 {
    // (Never the zeros: the callers' reads lie within `b`.)
    u64::from_le_bytes(*b[at..].first_chunk::<8>().unwrap_or(&[0; 8]))
}

/// Equality of short byte strings (field names, filter values, keys): eight bytes at a
/// time, inline; a call to memcmp costs more than the comparison.
#[inline]
pub fn short_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a.iter().zip(b).all(|(x, y)| x == y);
    }
    let mut i = 0;
    while i + 8 < n {
        if word(a, i) != word(b, i) {
            return false;
        }
        i += 8;
    }
    // The last eight bytes (overlapping the words compared when n is not a multiple of 8).
    word(a, n - 8) == word(b, n - 8)
}

impl KeyHasher {
    /// Seeds derived from `seed` (splitmix64), for tests that must not depend on chance.
    #[cfg(test)]
    fn seeded(seed: u64) -> KeyHasher {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        KeyHasher { seed: next(), expand: next(), fold: next() | 1 }
    }

    /// The hash of `b`: every byte and the length count (reads overlap when the length
    /// is not a multiple of 8, as foldhash's do; the length rotates the seed, so two keys
    /// that share their words but not their length differ).
    #[inline(always)]
    pub(crate) fn hash(&self, b: &[u8]) -> u64 {
        let len = b.len();
        let base = self.seed.rotate_right(len as u32) ^ len as u64;
        let (mut s0, mut s1) = (base, base.wrapping_add(self.expand));
        if len <= 16 {
            if len >= 8 {
                s0 ^= word(b, 0);
                s1 ^= word(b, len - 8);
            } else if len >= 4 {
                let half =
                    |at: usize| u64::from(u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]));
                s0 ^= half(0);
                s1 ^= half(len - 4);
            } else if len > 0 {
                s0 ^= u64::from(b[0]);
                s1 ^= (u64::from(b[len - 1]) << 8) | u64::from(b[len / 2]);
            }
            return folded_multiply(folded_multiply(s0, s1), self.fold);
        }
        // 16 bytes from the front and 16 from the back of each 32 not yet read (they
        // overlap when fewer than 32 are left).
        let halves = |front: &[u8; 16], back: &[u8; 16], s0: u64, s1: u64| {
            let w = |h: &[u8; 16], at: usize| {
                u64::from_le_bytes([
                    h[at],
                    h[at + 1],
                    h[at + 2],
                    h[at + 3],
                    h[at + 4],
                    h[at + 5],
                    h[at + 6],
                    h[at + 7],
                ])
            };
            (
                folded_multiply(w(front, 0) ^ s0, w(back, 0) ^ self.fold),
                folded_multiply(w(front, 8) ^ s1, w(back, 8) ^ self.fold),
            )
        };
        let sixteen = |at: usize| -> &[u8; 16] { b[at..].first_chunk::<16>().unwrap_or(&[0; 16]) };
        let (mut lo, mut hi) = (0usize, len);
        while lo < hi {
            (s0, s1) = halves(sixteen(lo), sixteen(hi - 16), s0, s1);
            lo += 16;
            hi -= 16;
        }
        folded_multiply(s0 ^ s1, self.fold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Keys of every length from 0 to 80 bytes, each byte changed in turn: no two of
    /// these (distinct) keys share a hash, nor the bucket bits of a 2^20-bucket table
    /// more often than chance would have them.
    #[test]
    fn every_byte_and_the_length_count() {
        let h = KeyHasher::default();
        let mut keys = Vec::new();
        for len in 0..=80usize {
            let base: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            keys.push(base.clone());
            for at in 0..len {
                let mut k = base.clone();
                k[at] ^= 1;
                keys.push(k);
            }
        }
        // Keys that differ by their length alone (zero bytes, every length): the length
        // counts on every path.
        keys.extend((1..=80usize).map(|len| vec![0; len]));
        let distinct: HashSet<&Vec<u8>> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
        let hashes: HashSet<u64> = keys.iter().map(|k| h.hash(k)).collect();
        assert_eq!(hashes.len(), keys.len(), "two keys share a hash");
        let buckets: HashSet<u64> = keys.iter().map(|k| h.hash(k) & ((1 << 20) - 1)).collect();
        // About 3 400 keys in 2^20 buckets: about 5.5 collisions expected (30 or more: p < 1e-12).
        assert!(keys.len() - buckets.len() < 30, "{} bucket collisions", keys.len() - buckets.len());
    }

    /// The marketplace's keys (product, market) spread over the bucket bits (the low
    /// bits) and the tag bits (the top 7) of the index as uniformly as chance, for a few
    /// fixed seeds (fixed, so that the test cannot fail by chance; the bounds would hold
    /// for a good hash with random seeds all but once in about a billion runs).
    #[test]
    fn realistic_keys_spread_over_buckets_and_tags() {
        for seed in [1, 2, 0xDEAD_BEEF] {
            let h = KeyHasher::seeded(seed);
            let mut buckets = vec![0u32; 1 << 12];
            let mut tags = [0u32; 128];
            for p in 0..500 * 8 {
                for m in 0..20 {
                    let mut k = Vec::new();
                    crate::state::push_key_field(&mut k, format!("producto-{p}").as_bytes());
                    crate::state::push_key_field(&mut k, format!("mercado-{m}").as_bytes());
                    let x = h.hash(&k);
                    buckets[(x & 0xFFF) as usize] += 1;
                    tags[(x >> 57) as usize] += 1;
                }
            }
            // 80 000 keys: 19.5 per bucket (sd 4.4) and 625 per tag (sd 25).
            let (bmin, bmax) = (buckets.iter().min().copied(), buckets.iter().max().copied());
            assert!(
                bmin >= Some(1) && bmax <= Some(60),
                "seed {seed}: buckets from {bmin:?} to {bmax:?} keys"
            );
            let (tmin, tmax) = (tags.iter().min().copied(), tags.iter().max().copied());
            assert!(
                tmin >= Some(450) && tmax <= Some(800),
                "seed {seed}: tags from {tmin:?} to {tmax:?} keys"
            );
        }
    }
}
