//! The rules a plugin must pass to take over an aggregation's state, written once for
//! the three ways it happens: a resume from a savepoint or checkpoint (`km0 run`), an
//! offline deploy (`km0 deploy PLUGIN.wasm --from-savepoint`) and a live deploy
//! (job/swap.rs). Each rule answers with a typed [`Refusal`]: what was refused leaves
//! the job (or the savepoint) as it was. Only the control API turns a refusal into an HTTP
//! status ([`crate::control`]), as Vector's `ReloadError` is turned into an answer by its
//! callers. The refusals themselves are [`crate::error::Refusal`].

pub use crate::error::Refusal;
use crate::pipeline::Pipeline;
use crate::plugin::{Field, FieldType, PluginIdentity};
use crate::state::saved::{SavedRow, SavedSlot, Value};
use crate::window::aggregator::Aggregator;

/// A plugin's name and version, as refusals say it.
fn who(p: &PluginIdentity) -> String {
    format!("{} {}", p.name, p.version)
}

/// The same logic: `offered` takes the state `held` kept for `aggregation` only under the
/// same plugin name.
pub fn same_logic(aggregation: &str, held: &PluginIdentity, offered: &PluginIdentity) -> Result<(), Refusal> {
    if held.name == offered.name {
        return Ok(());
    }
    Err(Refusal::OtherLogic {
        aggregation: aggregation.to_string(),
        held: held.name.clone(),
        offered: offered.name.clone(),
    })
}

/// A plugin reads at most as many key fields as the pipeline's key has.
pub fn key_fields(pipeline: &Pipeline, aggregation: &str, plugin: &dyn Aggregator) -> Result<(), Refusal> {
    let reads = plugin.identity().key_fields;
    if reads as usize <= pipeline.key.len() {
        return Ok(());
    }
    Err(Refusal::KeyFields {
        aggregation: aggregation.to_string(),
        plugin: who(plugin.identity()),
        reads,
        key: pipeline.key.clone(),
    })
}

/// Every saved key has the pipeline key's number of fields.
pub fn key_arity(pipeline: &Pipeline, slots: &[SavedSlot]) -> Result<(), Refusal> {
    let want = pipeline.key.len();
    match slots.iter().find(|s| crate::state::arity_of(&s.key) != Some(want)) {
        None => Ok(()),
        Some(bad) => Err(Refusal::KeyArity {
            fields: crate::state::fields_of(&bad.key).map(str::to_string).collect(),
            want,
        }),
    }
}

/// Rows held for an ordered plugin are restored into `plugin`'s columns: they must have
/// its fields' number and types (a plugin whose fields changed cannot take them). `held`:
/// how many rows are held, and the first that does not fit.
pub fn rows_fit(
    aggregation: &str,
    plugin: &dyn Aggregator,
    held: Option<(usize, &SavedRow)>,
) -> Result<(), Refusal> {
    let Some((rows, bad)) = held else { return Ok(()) };
    let fields = &plugin.info().fields;
    Err(Refusal::UnfitRows {
        aggregation: aggregation.to_string(),
        rows,
        plugin: who(plugin.identity()),
        values: bad.values.len(),
        first: format!("{:?}", bad.values),
        fields: fields.iter().map(|f| format!("{} ({:?})", f.name, f.type_)).collect(),
    })
}

/// Whether a held row's values fit a plugin's fields (number and types).
pub fn row_fits(values: &[Value], fields: &[Field]) -> bool {
    values.len() == fields.len()
        && values.iter().zip(fields).all(|(v, f)| {
            matches!(
                (v, f.type_),
                (Value::Int(_), FieldType::Int)
                    | (Value::Float(_), FieldType::Float)
                    | (Value::Text(_), FieldType::Text)
                    | (Value::Bool(_), FieldType::Boolean)
            )
        })
}

/// A migration that failed, said as a refusal.
pub fn migration_failed(old: &PluginIdentity, new: &PluginIdentity, source: crate::Error) -> Refusal {
    Refusal::Migration {
        plugin: who(new),
        to: new.state_schema,
        from_plugin: who(old),
        from: old.state_schema,
        source: Box::new(source),
    }
}

/// State schema migrations a restore did: (aggregation, from, to).
pub type Migrations = Vec<(String, u32, u32)>;

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str, schema: u32) -> PluginIdentity {
        PluginIdentity {
            name: name.into(),
            version: "0.1.0".into(),
            state_schema: schema,
            sha256: String::new(),
            contract: String::new(),
            key_fields: 0,
        }
    }

    #[test]
    fn only_a_plugin_of_the_same_name_takes_the_state() {
        assert!(same_logic("stock", &id("min-stock", 1), &id("min-stock", 2)).is_ok());
        let e = same_logic("stock", &id("min-stock", 1), &id("distance", 1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "aggregation \"stock\" holds state of plugin \"min-stock\"; plugin \"distance\" is different logic \
             and cannot take it"
        );
    }

    #[test]
    fn a_held_row_fits_only_fields_of_its_number_and_types() {
        let fields = |types: &[FieldType]| -> Vec<Field> {
            types.iter().map(|&t| Field { name: "f".into(), type_: t }).collect()
        };
        let row = [Value::Int(1), Value::Text("a".into())];
        assert!(row_fits(&row, &fields(&[FieldType::Int, FieldType::Text])));
        assert!(!row_fits(&row, &fields(&[FieldType::Int])));
        assert!(!row_fits(&row, &fields(&[FieldType::Float, FieldType::Text])));
    }
}
