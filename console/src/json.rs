//! Serializers for the shared strings of the frames (`Arc<str>`), without serde's `rc`
//! feature (which would rebuild every serde user of the dependency tree a second time).

use std::sync::Arc;

use serde::Serializer;

pub(crate) fn arc_str<S: Serializer>(value: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(value)
}

pub(crate) fn opt_arc_str<S: Serializer>(
    value: &Option<Arc<str>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) => s.serialize_some(&**v),
        None => s.serialize_none(),
    }
}

/// An action's body: a JSON object whose keys are all different. serde_json keeps the last of
/// two equal keys; an action with `{"slots": 2, "slots": 64}` is refused instead, so that what
/// the console does is never a guess between two values.
pub(crate) struct UniqueObject(pub(crate) serde_json::Map<String, serde_json::Value>);

impl<'de> serde::Deserialize<'de> for UniqueObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueObject;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut object = serde_json::Map::new();
                while let Some((key, value)) = map.next_entry::<String, serde_json::Value>()? {
                    if object.contains_key(&key) {
                        return Err(serde::de::Error::custom(format_args!(
                            "duplicate key `{key}`"
                        )));
                    }
                    object.insert(key, value);
                }
                Ok(UniqueObject(object))
            }
        }
        d.deserialize_map(Visitor)
    }
}
