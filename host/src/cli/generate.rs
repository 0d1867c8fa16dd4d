//! `km0 generate`: synthetic Kilómetro Cero streams (JSON lines) for trials and benchmarks.

use anyhow::{Context, Result};
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum Stream {
    /// `stock.actualizado` events with disorder and late arrivals.
    Stock {
        #[arg(long, default_value_t = 100_000)]
        events: u64,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        #[arg(long, default_value_t = 0.002)]
        late_fraction: f64,
        #[arg(long, default_value_t = 0.0)]
        bad_fraction: f64,
        #[arg(long, default_value_t = 50)]
        products: u32,
        #[arg(long, default_value_t = 20)]
        markets: u32,
        /// Event-time gap between consecutive events, ms.
        #[arg(long, default_value_t = 20)]
        gap_ms: i64,
        #[arg(long, short)]
        out: PathBuf,
    },
    /// `reparto.posiciones`: repartidores around Girona, with tunnels and silences.
    Delivery {
        #[arg(long, default_value_t = 140)]
        riders: u32,
        #[arg(long, default_value_t = 60)]
        minutes: u32,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Write a `particion` field with this many partitions.
        #[arg(long, default_value_t = 0)]
        partitions: u32,
        #[arg(long, short)]
        out: PathBuf,
    },
}

/// Write the stream asked for.
pub fn generate(stream: Stream) -> Result<()> {
    match stream {
        Stream::Delivery { riders, minutes, seed, partitions, out } => {
            let spec =
                km0::generate::DeliveryStream { riders, minutes, seed, partitions, ..Default::default() };
            let mut f = std::fs::File::create(&out).with_context(|| format!("create {}", out.display()))?;
            let n = km0::generate::delivery_stream(&spec, &mut f)
                .with_context(|| format!("write {}", out.display()))?;
            eprintln!("km0: wrote {n} positions of {riders} repartidores to {}", out.display());
        }
        Stream::Stock { events, seed, late_fraction, bad_fraction, products, markets, gap_ms, out } => {
            let spec = km0::generate::StockStream {
                events,
                seed,
                late_fraction,
                bad_fraction,
                products,
                markets,
                gap_ms,
                ..Default::default()
            };
            let mut f = std::fs::File::create(&out).with_context(|| format!("create {}", out.display()))?;
            let g = km0::generate::stock_stream(&spec, &mut f)
                .with_context(|| format!("write {}", out.display()))?;
            eprintln!(
                "km0: wrote {} records to {} ({} stock events, {} other, {} malformed)",
                g.records,
                out.display(),
                g.stock_events,
                g.other,
                g.bad
            );
        }
    }
    Ok(())
}
