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

/// Shape of a generated `reparto.posiciones` stream (the delivery panel, case (b)).
#[derive(Debug, Clone)]
pub struct DeliveryStream {
    pub riders: u32,
    /// Event-time span of the stream.
    pub minutes: u32,
    pub seed: u64,
    /// Event time of the first positions, epoch ms (default 2025-09-14 10:00 UTC).
    pub start_ms: i64,
    /// Mean time between two positions of one rider, ms.
    pub interval_ms: i64,
    /// Tunnels: positions logged without coverage arrive in a burst on the way out.
    pub tunnels: bool,
    /// Silences of 4-10 minutes (the sessions the panel reports).
    pub silences: bool,
    /// `furgoneta-3`'s phone is off for 5 minutes and resends them 22 minutes late.
    pub late_resend: bool,
    /// Number of partitions written into the `particion` field (0: no field).
    pub partitions: u32,
}

impl Default for DeliveryStream {
    fn default() -> Self {
        DeliveryStream {
            riders: 140,
            minutes: 60,
            seed: 7,
            start_ms: 1_757_844_000_000,
            interval_ms: 10_000,
            tunnels: true,
            silences: true,
            late_resend: true,
            partitions: 0,
        }
    }
}

/// Name of rider `i` (0-based): furgonetas, motos and bicis.
pub fn rider_name(i: u32) -> String {
    let kind = ["furgoneta", "moto", "bici"][i as usize % 3];
    format!("{kind}-{}", i / 3 + 1)
}

/// Write the stream in arrival order; returns how many positions were written.
pub fn delivery_stream(spec: &DeliveryStream, out: &mut impl Write) -> io::Result<u64> {
    let mut rng = Rng::new(spec.seed);
    // (arrival, event time, rider, lat, lon)
    let mut evs: Vec<(i64, i64, u32, f64, f64)> = Vec::new();
    let end = spec.start_ms + spec.minutes as i64 * 60_000;
    let resend_rider = 6; // rider_name(6) == "furgoneta-3"
    for r in 0..spec.riders {
        let mut lat = 41.9794 + (rng.unit() - 0.5) * 0.04;
        let mut lon = 2.8214 + (rng.unit() - 0.5) * 0.06;
        let base_speed = [7.0, 9.0, 4.0][r as usize % 3];
        let mut heading = rng.unit() * std::f64::consts::TAU;
        let mut t = spec.start_ms + rng.below(spec.interval_ms as u64) as i64;
        let mut tunnel_until = i64::MIN;
        let mut stopped_until = i64::MIN;
        while t < end {
            let dt = spec.interval_ms / 2 + rng.below(spec.interval_ms as u64) as i64;
            if spec.silences && rng.unit() < 0.002 {
                t += 240_000 + rng.below(360_000) as i64; // no signal for 4-10 minutes
                continue;
            }
            if rng.unit() < 0.01 {
                stopped_until = t + 60_000 + rng.below(120_000) as i64; // a delivery stop
            }
            let speed = if t < stopped_until { 0.0 } else { base_speed * (0.5 + rng.unit()) };
            heading += (rng.unit() - 0.5) * 0.6;
            let metres = speed * dt as f64 / 1000.0;
            lat += metres * heading.cos() / 111_320.0;
            lon += metres * heading.sin() / (111_320.0 * lat.to_radians().cos());
            if spec.tunnels && t > tunnel_until && rng.unit() < 0.003 {
                tunnel_until = t + 60_000 + rng.below(120_000) as i64;
            }
            let mut arrival =
                t + if rng.unit() < 0.01 { rng.below(45_000) } else { 300 + rng.below(1_700) } as i64;
            if t < tunnel_until {
                arrival = tunnel_until + rng.below(3_000) as i64; // the burst on the way out
            }
            let resend_from = spec.start_ms + 20 * 60_000;
            if spec.late_resend && r == resend_rider && t >= resend_from && t < resend_from + 5 * 60_000 {
                arrival = t + 22 * 60_000;
            }
            evs.push((arrival, t, r, lat, lon));
            t += dt;
        }
    }
    evs.sort_by_key(|a| (a.0, a.1, a.2));
    let mut w = io::BufWriter::with_capacity(1 << 20, out);
    for &(arrival, t, r, lat, lon) in &evs {
        let part = if spec.partitions > 0 {
            format!(", \"particion\": {}", r % spec.partitions)
        } else {
            String::new()
        };
        writeln!(
            w,
            "{{\"repartidor\": \"{}\", \"lat\": {lat:.6}, \"lon\": {lon:.6}, \"fecha_ms\": {t}, \"llegada_ms\": {arrival}{part}}}",
            rider_name(r)
        )?;
    }
    w.flush()?;
    Ok(evs.len() as u64)
}

/// Split JSON lines into `parts` files in `dir` by a hash (FNV-1a) of `field`'s value, as a
/// producer keyed by that field would: each value's records in one file, in order. Lines
/// without the field go by their number.
pub fn split_by_field(
    input: &std::path::Path,
    field: &str,
    parts: usize,
    dir: &std::path::Path,
) -> io::Result<Vec<std::path::PathBuf>> {
    use std::io::BufRead;
    let paths: Vec<std::path::PathBuf> = (0..parts).map(|i| dir.join(format!("part-{i}.jsonl"))).collect();
    let mut outs = paths
        .iter()
        .map(|p| std::fs::File::create(p).map(io::BufWriter::new))
        .collect::<io::Result<Vec<_>>>()?;
    for (i, line) in io::BufReader::new(std::fs::File::open(input)?).lines().enumerate() {
        let line = line?;
        let value = serde_json::from_str::<serde_json::Value>(&line).ok().and_then(|v| match &v[field] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        });
        let p = match value {
            Some(v) => v
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
                as usize,
            None => i,
        };
        let out = &mut outs[p % parts.max(1)];
        out.write_all(line.as_bytes())?;
        out.write_all(b"\n")?;
    }
    for mut o in outs {
        o.flush()?;
    }
    Ok(paths)
}
