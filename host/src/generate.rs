//! Synthetic input for examples, tests and benchmarks: a Kilómetro Cero stock stream
//! (`stock.actualizado` events) with realistic disorder, a share of events that arrive
//! after the watermark, other event types the filter drops, and optionally malformed
//! lines. Deterministic for a given seed.

use std::io::{self, Write};

/// Shape of a generated stock stream.
#[derive(Debug, Clone)]
pub struct StockStream {
    pub events: u64,
    pub seed: u64,
    pub products: u32,
    pub markets: u32,
    /// Event time of the first event, epoch ms (default 2025-09-14 08:00 UTC).
    pub start_ms: i64,
    /// Event-time gap between consecutive events, ms.
    pub gap_ms: i64,
    /// Share of events delayed by 3-10 minutes (late under a 2-minute watermark).
    pub late_fraction: f64,
    /// Share of records of another event type (filtered out by `tipo`).
    pub other_fraction: f64,
    /// Share of malformed records (dead letters).
    pub bad_fraction: f64,
}

impl Default for StockStream {
    fn default() -> Self {
        StockStream {
            events: 100_000,
            seed: 42,
            products: 50,
            markets: 20,
            start_ms: 1_757_836_800_000,
            gap_ms: 20,
            late_fraction: 0.002,
            other_fraction: 0.03,
            bad_fraction: 0.0,
        }
    }
}

/// What was generated, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Generated {
    pub records: u64,
    pub stock_events: u64,
    pub other: u64,
    pub bad: u64,
}

const PRODUCTS: &[&str] = &[
    "queso-curado",
    "aceite-arbequina",
    "miel-romero",
    "vino-priorat",
    "pan-payes",
    "tomate-rosa",
    "butifarra",
    "mato",
    "avellanas",
    "fuet",
    "manzana-girona",
    "cava-brut",
    "yogur-oveja",
    "huevos-corral",
    "alcachofa",
    "calcots",
    "setas-rovellons",
    "arroz-delta",
    "pera-lleida",
    "mermelada-higo",
];
const MARKETS: &[&str] =
    &["girona", "barcelona", "lleida", "tarragona", "vic", "figueres", "reus", "manresa", "olot", "sabadell"];
const REPLICAS: &[&str] = &["inv-bcn", "inv-vlc", "inv-gir"];

/// SplitMix64: small, fast, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn name(list: &[&str], i: u32) -> String {
    let base = list[i as usize % list.len()];
    match i as usize / list.len() {
        0 => base.to_string(),
        n => format!("{base}-{n}"),
    }
}

/// Write the stream, one JSON object per line, in arrival order.
pub fn stock_stream(spec: &StockStream, out: &mut impl Write) -> io::Result<Generated> {
    let mut rng = Rng::new(spec.seed);
    let products: Vec<String> = (0..spec.products.max(1)).map(|i| name(PRODUCTS, i)).collect();
    let markets: Vec<String> = (0..spec.markets.max(1)).map(|i| name(MARKETS, i)).collect();
    let n_keys = products.len() * markets.len();
    let mut stock: Vec<i64> = (0..n_keys).map(|_| 10 + rng.below(50) as i64).collect();

    // (arrival, sequence, kind, key, event time, stock, delta)
    struct Ev {
        arrival: i64,
        seq: u64,
        kind: u8,
        key: u32,
        t: i64,
        stock: i64,
        delta: i64,
        replica: u8,
    }
    let mut evs = Vec::with_capacity(spec.events as usize);
    for i in 0..spec.events {
        let t = spec.start_ms + i as i64 * spec.gap_ms;
        let r = rng.unit();
        let delay = if r < spec.late_fraction {
            180_000 + rng.below(420_000) as i64
        } else if r < spec.late_fraction + 0.10 {
            rng.below(90_000) as i64
        } else {
            rng.below(5_000) as i64
        };
        let u = rng.unit();
        let kind = if u < spec.bad_fraction {
            2
        } else if u < spec.bad_fraction + spec.other_fraction {
            1
        } else {
            0
        };
        let key = rng.below(n_keys as u64) as u32;
        let delta = rng.below(11) as i64 - 6;
        let s = &mut stock[key as usize];
        *s = (*s + delta).clamp(0, 80);
        if *s == 0 {
            *s = 40; // restocked
        }
        evs.push(Ev {
            arrival: t + delay,
            seq: i,
            kind,
            key,
            t,
            stock: *s,
            delta,
            replica: rng.below(3) as u8,
        });
    }
    evs.sort_by_key(|e| (e.arrival, e.seq));

    let mut g = Generated::default();
    let mut w = io::BufWriter::with_capacity(1 << 20, out);
    for e in &evs {
        let producto = &products[e.key as usize / markets.len()];
        let mercado = &markets[e.key as usize % markets.len()];
        g.records += 1;
        match e.kind {
            0 => {
                g.stock_events += 1;
                writeln!(
                    w,
                    "{{\"tipo\": \"stock.actualizado\", \"producto\": \"{producto}\", \"mercado\": \"{mercado}\", \"stock_actual\": {}, \"delta\": {}, \"replica\": \"{}\", \"fecha_ms\": {}, \"llegada_ms\": {}}}",
                    e.stock, e.delta, REPLICAS[e.replica as usize], e.t, e.arrival
                )?;
            }
            1 => {
                g.other += 1;
                writeln!(
                    w,
                    "{{\"tipo\": \"pedido.creado\", \"pedido_id\": \"p-{}\", \"mercado\": \"{mercado}\", \"importe\": {}.{:02}, \"fecha_ms\": {}}}",
                    e.seq,
                    e.stock * 3,
                    e.seq % 100,
                    e.t
                )?;
            }
            _ => {
                g.bad += 1;
                let line = match e.seq % 5 {
                    0 => format!("{{\"tipo\": \"stock.actualizado\", \"producto\": \"{producto}\", \"mercado\": \"{mercado}\", \"stock_actual\": {}", e.stock),
                    1 => format!("{{\"tipo\": \"stock.actualizado\", \"producto\": \"{producto}\", \"mercado\": \"{mercado}\", \"stock_actual\": {}, \"delta\": 0, \"fecha_ms\": \"{}\"}}", e.stock, e.t),
                    2 => format!("{{\"tipo\": \"stock.actualizado\", \"producto\": \"{producto}\", \"mercado\": \"{mercado}\", \"stock_actual\": {}, \"delta\": 0, \"fecha_ms\": {}.5}}", e.stock, e.t),
                    3 => format!("{{\"tipo\": \"stock.actualizado\", \"mercado\": \"{mercado}\", \"stock_actual\": {}, \"delta\": 0, \"fecha_ms\": {}}}", e.stock, e.t),
                    _ => "stock.actualizado queso-curado girona 7".to_string(),
                };
                writeln!(w, "{line}")?;
            }
        }
    }
    w.flush()?;
    Ok(g)
}
