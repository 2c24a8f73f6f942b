//! Bounds on a request's grammar, checked before llguidance sees it.
//!
//! llguidance checks its own size limits only after it has built the
//! grammar, and building it may recurse once per property or build tables
//! quadratic in an object's properties: a 560 KB schema of 40,000 empty
//! properties overflowed a 2 MiB stack, and 20,000 optional properties under
//! `minProperties` asked for ~9.6 GB. So a spec is measured here first, by
//! a walk that uses no recursion, and refused with the bound it breaks.
//!
//! The walk is blind to JSON Schema's meaning (a property *named*
//! `properties` counts as a `properties` keyword), so it may overcount,
//! never undercount. Where llguidance merges schemas in place (a `$ref`
//! beside other keywords, an `allOf`, alternatives beside other keywords)
//! it builds a new object of its own for each such place, so the bounds on
//! objects are counted there on the object as merged: its properties and
//! `minProperties` gathered through every `$ref`, `allOf`, `anyOf` and
//! `oneOf` in place, once per place and per alternative. What passes is then compiled by `compile` on its own
//! thread under a time budget, with llguidance's own limits set
//! ([`parser_limits`]).

use llguidance::api::ParserLimits;
use serde_json::Value;

use super::{GrammarError, GrammarSpec};

/// The longest spec, as compact JSON (all of a request's tool schemas
/// together).
pub const MAX_SPEC_BYTES: usize = 128 * 1024;
/// Keys of all `properties` objects in a spec together.
pub const MAX_PROPERTIES: usize = 2_000;
/// The deepest JSON nesting inside one schema (each level of a JSON
/// Schema object is two: `properties`, then the property's schema).
pub const MAX_DEPTH: usize = 64;
/// Values of all `enum` lists in a spec together.
pub const MAX_ENUM_VALUES: usize = 2_000;
/// The longest regular expression (`pattern`, a `patternProperties` key,
/// `x-guidance.whitespace_pattern`), in bytes.
pub const MAX_PATTERN_BYTES: usize = 1_000;
/// The most properties in one object that also sets `minProperties` or
/// `maxProperties`: llguidance lists one alternative per optional
/// property, each naming every property (n x n). One such object of 128
/// takes ~25-50 MB to compile.
pub const MAX_COUNTED_PROPERTIES: usize = 128;
/// The n x n tables of all such objects together (the sum of their n²):
/// two objects of 90 cost as much as one of 128, fifteen of 128 (~245,000
/// cells) more than 150 MB, and past ~65,000 grammar symbols llguidance
/// fails an assertion. An object merged in place (through `$ref` or
/// `allOf`) counts at each place, times its alternatives there: 64
/// places that each add `minProperties` to one 128-property definition
/// are 64 tables.
pub const MAX_COUNTED_CELLS: usize = MAX_COUNTED_PROPERTIES * MAX_COUNTED_PROPERTIES;
/// The alternatives one `allOf` can multiply into: llguidance intersects
/// an `allOf`'s branches, distributing the intersection over each branch's
/// `anyOf`/`oneOf` (ten branches of two alternatives, a 957-byte schema,
/// are 1,024 alternatives and ~50-100 MB to compile). Counted as
/// llguidance distributes: a schema's alternatives are the sum over its
/// `anyOf` (or `oneOf`) options of theirs, times those of its `$ref`'s
/// target, times the product over its `allOf` branches. Alternatives of
/// properties that two branches share are intersected pairwise too; those
/// stay under llguidance's own cap of 50,000 schema nodes.
pub const MAX_ALLOF_PRODUCT: usize = 256;
/// The alternatives of every `allOf` in a spec together (those of more
/// than one): each is intersected on its own, so two `allOf`s of 256 cost
/// what one of 512 would.
pub const MAX_ALLOF_TOTAL: usize = MAX_ALLOF_PRODUCT;
/// Schemas visited while counting [`MAX_ALLOF_PRODUCT`] for one spec; a
/// `$ref` cycle through an `allOf` or an `anyOf` spends them and is
/// refused.
const MAX_ALLOF_STEPS: usize = 200_000;
/// Schemas and property names visited while merging objects in place
/// (see the module doc) for one spec; past it the spec is refused.
const MAX_MERGE_STEPS: usize = 400_000;
/// The keywords llguidance merges in place (intersects with the rest of
/// their object).
const IN_PLACE: [&str; 6] = ["allOf", "anyOf", "oneOf", "$ref", "const", "enum"];
/// Keywords that constrain nothing (llguidance's annotations): an object
/// of a `$ref` and these only is a plain reference, compiled once.
const ANNOTATIONS: [&str; 14] = [
    "$anchor",
    "$comment",
    "$defs",
    "$id",
    "$schema",
    "definitions",
    "default",
    "deprecated",
    "description",
    "examples",
    "readOnly",
    "title",
    "writeOnly",
    "x-guidance",
];
/// Alternatives (`anyOf`, `oneOf`, `allOf` elements) in a spec together.
pub const MAX_ALTERNATIVES: usize = 1_000;
/// Tools in one forced tool-call grammar.
pub const MAX_TOOLS: usize = 128;

/// The parser's items in one row (llguidance's default: 2,000). What the
/// bounds above admit needs more: right after the `{` of an object, one
/// item per alternative that may come next (~16,500 for a 128 x 128
/// table, ~8,000 for 2,000 optional properties, ~10,000 for 256 `allOf`
/// alternatives). With the default, such a grammar compiled and then
/// failed at its first token, a 5xx in mid-answer; a row is 8 bytes an
/// item, so this costs at most ~200 kB a row.
pub const MAX_ITEMS_IN_ROW: usize = 25_000;

/// llguidance's own limits for every grammar compiled here, each named
/// (no field left to a default that a new llguidance version could
/// change). Those that bound memory: `max_lexer_states` (each ~1-2 kB; the
/// default 250,000 could hold ~500 MB for one request), `max_grammar_size`
/// (symbols; a spec within the bounds above stays below it),
/// `initial_lexer_fuel` (the regex nodes built for the lexer) and
/// `step_max_items` / `max_items_in_row` (the parser's items per mask and
/// per row). llguidance checks the grammar size only once the grammar is
/// built, so the bounds above are what keep a compile small; these bound
/// what a compiled grammar can grow to while it decodes. The schema
/// builder's own cap (50,000 schema nodes) is not configurable. Errors
/// reach clients as 400s, so they say the reason, not the parser's state.
pub(super) fn parser_limits() -> ParserLimits {
    ParserLimits {
        max_items_in_row: MAX_ITEMS_IN_ROW,
        initial_lexer_fuel: 1_000_000,
        step_lexer_fuel: 200_000,
        step_max_items: 50_000,
        max_lexer_states: 50_000,
        max_grammar_size: 200_000,
        precompute_large_lexemes: true,
        verbose_errors: false,
    }
}

/// Checks `spec` against every bound above.
///
/// Errors: [`GrammarError::Invalid`] naming the part of the spec (as
/// [`super::build::top_level`] does) and the bound it breaks.
pub(super) fn check(spec: &GrammarSpec) -> Result<(), GrammarError> {
    match spec {
        GrammarSpec::JsonObject => Ok(()),
        GrammarSpec::JsonSchema(schema) | GrammarSpec::MarkupJson { schema, .. } => {
            let mut tally = Tally::default();
            tally.bytes(schema);
            tally.walk(schema);
            tally.verdict(super::build::JSON_SCHEMA)
        }
        GrammarSpec::ToolCalls { tools, .. } | GrammarSpec::MarkupCalls { tools, .. } => {
            let label = super::build::TOOLS;
            if tools.len() > MAX_TOOLS {
                return Err(GrammarError::Invalid(format!(
                    "{label}: {} tools; at most {MAX_TOOLS} can be forced",
                    tools.len()
                )));
            }
            let mut tally = Tally::default();
            for (name, schema) in tools {
                tally.spec_bytes += name.len();
                tally.bytes(schema);
                tally.walk(schema);
            }
            tally.verdict(label)
        }
    }
}

/// What the walk counted; `broken` is the first bound found broken inside
/// one value (depth, a pattern, an object's counted properties).
#[derive(Default)]
struct Tally {
    spec_bytes: usize,
    properties: usize,
    counted_cells: usize,
    allof_steps: usize,
    allof_total: usize,
    merge_steps: usize,
    enum_values: usize,
    alternatives: usize,
    broken: Option<String>,
}

impl Tally {
    fn bytes(&mut self, v: &Value) {
        // Compact JSON of a parsed value cannot fail to serialize.
        self.spec_bytes += serde_json::to_vec(v).map_or(usize::MAX, |b| b.len());
    }

    fn fail(&mut self, why: String) {
        self.broken.get_or_insert(why);
    }

    /// Visits every value of `root` with an explicit stack (a request's
    /// JSON is at most 128 deep, but nothing here relies on that).
    fn walk(&mut self, root: &Value) {
        let mut stack: Vec<(&Value, usize)> = vec![(root, 1)];
        while let Some((v, depth)) = stack.pop() {
            if depth > MAX_DEPTH {
                self.fail(format!(
                    "the schema is nested more than {MAX_DEPTH} levels deep"
                ));
                continue;
            }
            match v {
                Value::Array(items) => stack.extend(items.iter().map(|i| (i, depth + 1))),
                Value::Object(map) => {
                    self.keywords(root, map);
                    stack.extend(map.values().map(|i| (i, depth + 1)));
                }
                _ => {}
            }
        }
    }

    /// Counts the keywords of one object that the bounds are about.
    /// `root` is the schema `map` is in (where its `$ref`s point).
    fn keywords(&mut self, root: &Value, map: &serde_json::Map<String, Value>) {
        if let Some(Value::Object(props)) = map.get("properties") {
            self.properties += props.len();
        }
        if merges_in_place(map) {
            self.merged_object(root, map);
        } else if let Some(Value::Object(props)) = map.get("properties") {
            if map.contains_key("minProperties") || map.contains_key("maxProperties") {
                self.counted(props.len(), 1, "");
            }
        }
        if let Some(Value::Array(values)) = map.get("enum") {
            self.enum_values += values.len();
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            if let Some(Value::Array(alts)) = map.get(key) {
                self.alternatives += alts.len();
            }
        }
        if map.contains_key("allOf") {
            let product = self.alternatives_of(root, map, 0);
            if product > MAX_ALLOF_PRODUCT {
                self.fail(format!(
                    "an allOf multiplies the anyOf/oneOf alternatives under it into more \
                     than {MAX_ALLOF_PRODUCT} (or refers to itself)"
                ));
            }
            // One past the bound is reported as such, not in the total.
            if (2..=MAX_ALLOF_PRODUCT).contains(&product) {
                self.allof_total = self.allof_total.saturating_add(product);
            }
        }
        for key in ["pattern", "whitespace_pattern"] {
            if let Some(Value::String(p)) = map.get(key) {
                self.pattern(p);
            }
        }
        if let Some(Value::Object(pp)) = map.get("patternProperties") {
            pp.keys().for_each(|p| self.pattern(p));
        }
    }

    /// One n x n table of `n` properties per alternative (`alternatives`
    /// of them); `how` tells where the properties came from.
    fn counted(&mut self, n: usize, alternatives: usize, how: &str) {
        let cells = n.saturating_mul(n).saturating_mul(alternatives);
        self.counted_cells = self.counted_cells.saturating_add(cells);
        if n > MAX_COUNTED_PROPERTIES {
            self.fail(format!(
                "an object with minProperties or maxProperties lists {n} properties{how}; \
                 at most {MAX_COUNTED_PROPERTIES} are allowed there"
            ));
        }
    }

    /// The object `map` becomes once llguidance has merged its in-place
    /// keywords: when `minProperties` or `maxProperties` is anywhere in
    /// what it merges, one table of all the properties merged (their
    /// union: an overcount where alternatives differ) per alternative.
    fn merged_object(&mut self, root: &Value, map: &serde_json::Map<String, Value>) {
        let mut seen: std::collections::HashSet<*const serde_json::Map<String, Value>> =
            Default::default();
        let mut merged = Vec::new();
        let mut stack = vec![map];
        while let Some(m) = stack.pop() {
            if !seen.insert(m as *const _) {
                continue;
            }
            merged.push(m);
            self.merge_steps += 1;
            if self.merge_steps > MAX_MERGE_STEPS {
                self.fail(format!(
                    "$ref/allOf/anyOf/oneOf merge more than {MAX_MERGE_STEPS} schemas \
                     in place"
                ));
                return;
            }
            if let Some(Value::String(r)) = m.get("$ref") {
                if let Some(Value::Object(target)) =
                    r.strip_prefix('#').and_then(|p| root.pointer(p))
                {
                    stack.push(target);
                }
            }
            for key in ["allOf", "anyOf", "oneOf"] {
                if let Some(Value::Array(parts)) = m.get(key) {
                    stack.extend(parts.iter().filter_map(Value::as_object));
                }
            }
        }
        let counted = merged
            .iter()
            .any(|m| m.contains_key("minProperties") || m.contains_key("maxProperties"));
        if counted {
            let names: std::collections::HashSet<&str> = merged
                .iter()
                .filter_map(|m| m.get("properties").and_then(Value::as_object))
                .flat_map(|props| props.keys().map(String::as_str))
                .collect();
            let alternatives = self.alternatives_of(root, map, 0);
            self.counted(
                names.len(),
                alternatives,
                " once its $ref/allOf/anyOf/oneOf are merged",
            );
        }
    }

    /// The alternatives `map` stands for once llguidance has distributed
    /// its intersections (see [`MAX_ALLOF_PRODUCT`]), `$ref`s into `root`
    /// followed each time they are met; anything past the bound (or past
    /// the spec's [`MAX_ALLOF_STEPS`], or nested deeper than twice
    /// [`MAX_DEPTH`] through references) is `MAX_ALLOF_PRODUCT + 1`.
    fn alternatives_of(
        &mut self,
        root: &Value,
        map: &serde_json::Map<String, Value>,
        depth: usize,
    ) -> usize {
        const OVER: usize = MAX_ALLOF_PRODUCT + 1;
        self.allof_steps += 1;
        if self.allof_steps > MAX_ALLOF_STEPS || depth > 2 * MAX_DEPTH {
            return OVER;
        }
        let of = |this: &mut Self, v: &Value| match v {
            Value::Object(m) => this.alternatives_of(root, m, depth + 1),
            _ => 1,
        };
        let mut product = 1usize;
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(options)) = map.get(key) {
                let mut sum = 0usize;
                for o in options {
                    sum = sum.saturating_add(of(self, o)).min(OVER);
                }
                product = product.saturating_mul(sum.max(1)).min(OVER);
            }
        }
        if let Some(Value::String(r)) = map.get("$ref") {
            if let Some(target) = r.strip_prefix('#').and_then(|p| root.pointer(p)) {
                product = product.saturating_mul(of(self, target)).min(OVER);
            }
        }
        if let Some(Value::Array(branches)) = map.get("allOf") {
            for b in branches {
                product = product.saturating_mul(of(self, b)).min(OVER);
            }
        }
        product
    }

    fn pattern(&mut self, p: &str) {
        if p.len() > MAX_PATTERN_BYTES {
            self.fail(format!(
                "a pattern of {} bytes; at most {MAX_PATTERN_BYTES} are allowed",
                p.len()
            ));
        }
    }

    fn verdict(mut self, label: &str) -> Result<(), GrammarError> {
        let over = |what: &str, n: usize, max: usize| {
            (n > max).then(|| format!("{n} {what}; at most {max} are allowed"))
        };
        let why = over("bytes of schema", self.spec_bytes, MAX_SPEC_BYTES)
            .or_else(|| over("properties", self.properties, MAX_PROPERTIES))
            .or_else(|| {
                over(
                    "cells of minProperties/maxProperties tables (n x n per object, and per \
                     place a $ref or allOf merges one)",
                    self.counted_cells,
                    MAX_COUNTED_CELLS,
                )
            })
            .or_else(|| {
                over(
                    "allOf alternatives in all (each allOf's anyOf/oneOf alternatives \
                     multiplied, summed over the allOfs)",
                    self.allof_total,
                    MAX_ALLOF_TOTAL,
                )
            })
            .or_else(|| over("enum values", self.enum_values, MAX_ENUM_VALUES))
            .or_else(|| {
                over(
                    "anyOf/oneOf/allOf alternatives",
                    self.alternatives,
                    MAX_ALTERNATIVES,
                )
            })
            .or_else(|| self.broken.take());
        match why {
            None => Ok(()),
            Some(why) => Err(GrammarError::Invalid(format!(
                "{label}: too large to compile: {why}"
            ))),
        }
    }
}

/// Whether llguidance merges `map` in place into an object of its own:
/// two or more parts among its in-place keywords (each `allOf` branch
/// one) and the rest of its constraining keywords (one part together).
/// A `$ref` with annotations only is a plain reference, and a lone
/// `anyOf` or `oneOf` keeps its options apart (each is walked on its own).
fn merges_in_place(map: &serde_json::Map<String, Value>) -> bool {
    let mut parts = 0usize;
    let mut rest = false;
    for (k, v) in map {
        match (k.as_str(), v) {
            ("allOf", Value::Array(branches)) => parts += branches.len(),
            (k, _) if IN_PLACE.contains(&k) => parts += 1,
            (k, _) if ANNOTATIONS.contains(&k) => {}
            _ => rest = true,
        }
    }
    let touched = map.keys().any(|k| IN_PLACE.contains(&k.as_str()));
    touched && parts + usize::from(rest) >= 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map};

    fn props(n: usize) -> Map<String, Value> {
        (0..n).map(|i| (format!("p{i}"), json!({}))).collect()
    }

    fn refused(spec: &GrammarSpec) -> String {
        match check(spec) {
            Err(GrammarError::Invalid(m)) => m,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn the_issue_schemas_are_refused_by_count_and_a_fair_one_passes() {
        let wide = json!({"type": "object", "properties": props(40_000)});
        let m = refused(&GrammarSpec::JsonSchema(wide.clone()));
        assert!(
            m.starts_with("response_format json_schema: too large"),
            "{m}"
        );
        let square = json!({"type": "object", "properties": props(20_000),
            "minProperties": 1, "additionalProperties": false});
        refused(&GrammarSpec::JsonSchema(square));
        let tools = GrammarSpec::ToolCalls {
            tools: vec![("f".into(), wide)],
            parallel: false,
        };
        assert!(refused(&tools).starts_with("tools: "));
        // Just under each bound passes.
        let fair = json!({"type": "object", "properties": props(MAX_COUNTED_PROPERTIES),
            "minProperties": 1, "additionalProperties": false,
            "enum": vec![json!(1); 10]});
        check(&GrammarSpec::JsonSchema(fair)).unwrap();
    }

    /// The widest and the deepest schemas the bounds allow compile, from a
    /// caller whose stack (64 KiB) would not hold llguidance's recursion:
    /// compiles run on their own thread.
    #[test]
    fn what_the_bounds_allow_compiles_from_a_small_stack() {
        use crate::grammar::Grammars;
        use crate::tokenizer::testing::tiny_metadata;
        use crate::tokenizer::TextTokenizer;
        let tok = TextTokenizer::from_gguf_metadata(&tiny_metadata()).unwrap();
        let grammars = Grammars::new(&tok, tok.vocab_size()).unwrap();
        let wide = json!({"type": "object", "properties": props(MAX_PROPERTIES)});
        let square = json!({"type": "object", "properties": props(MAX_COUNTED_PROPERTIES),
            "minProperties": 1, "additionalProperties": false});
        let mut deep = json!({"type": "integer"});
        for _ in 0..MAX_DEPTH / 2 - 1 {
            deep = json!({"type": "array", "items": deep});
        }
        let t = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                [wide, square, deep]
                    .into_iter()
                    .map(|s| grammars.compile(&GrammarSpec::JsonSchema(s)).map(|_| ()))
                    .collect::<Vec<_>>()
            })
            .unwrap();
        for (i, r) in t.join().unwrap().into_iter().enumerate() {
            assert!(r.is_ok(), "schema {i}: {r:?}");
        }
    }

    /// `n` branches, each an `anyOf` of two, under one `allOf`: 2^n
    /// alternatives once intersected; `by_ref`: each branch a `$ref` to a
    /// definition holding the `anyOf`.
    fn allof_of_anyofs(n: usize, by_ref: bool) -> Value {
        let alt = |i: usize| {
            json!({"anyOf": [{"properties": {format!("a{i}"): {"type": "integer"}}},
                {"properties": {format!("b{i}"): {"type": "string"}}}]})
        };
        if by_ref {
            let defs: Map<String, Value> = (0..n).map(|i| (format!("d{i}"), alt(i))).collect();
            let refs: Vec<Value> = (0..n)
                .map(|i| json!({"$ref": format!("#/$defs/d{i}")}))
                .collect();
            json!({"$defs": defs, "type": "object", "allOf": refs})
        } else {
            json!({"type": "object", "allOf": (0..n).map(alt).collect::<Vec<_>>()})
        }
    }

    #[test]
    fn an_allof_over_alternatives_is_bounded_by_their_product() {
        let fits = MAX_ALLOF_PRODUCT.ilog2() as usize;
        for by_ref in [false, true] {
            check(&GrammarSpec::JsonSchema(allof_of_anyofs(fits, by_ref))).unwrap();
            let m = refused(&GrammarSpec::JsonSchema(allof_of_anyofs(fits + 1, by_ref)));
            assert!(m.contains("allOf multiplies"), "{m}");
        }
        // Alternatives inside properties are not distributed over: a base
        // schema and optional fields, as generated code writes them.
        let optional = |i: usize| {
            (
                format!("p{i}"),
                json!({"anyOf": [{"type": "integer"}, {"type": "null"}]}),
            )
        };
        let derived = json!({"$defs": {"base": {"properties": (0..12).map(optional)
            .collect::<Map<_, _>>()}},
            "properties": (12..24).map(optional).collect::<Map<_, _>>(),
            "allOf": [{"$ref": "#/$defs/base"}]});
        check(&GrammarSpec::JsonSchema(derived)).unwrap();
        // A definition that refers to itself under an allOf.
        let cycle =
            json!({"$defs": {"n": {"allOf": [{"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"});
        assert!(refused(&GrammarSpec::JsonSchema(cycle)).contains("allOf"));
    }

    /// The allOf shapes at the bound compile; the schema one past it is the
    /// one that took ~100 MB (ten lists of two).
    #[test]
    fn an_allof_at_the_bound_compiles() {
        use crate::grammar::Grammars;
        use crate::tokenizer::testing::tiny_metadata;
        use crate::tokenizer::TextTokenizer;
        let tok = TextTokenizer::from_gguf_metadata(&tiny_metadata()).unwrap();
        let grammars = Grammars::new(&tok, tok.vocab_size()).unwrap();
        let fits = MAX_ALLOF_PRODUCT.ilog2() as usize;
        for by_ref in [false, true] {
            let spec = GrammarSpec::JsonSchema(allof_of_anyofs(fits, by_ref));
            assert!(grammars.compile(&spec).is_ok(), "by_ref {by_ref}");
        }
    }

    #[test]
    fn each_bound_is_enforced() {
        let square = json!({"properties": props(MAX_COUNTED_PROPERTIES + 1), "maxProperties": 3});
        assert!(refused(&GrammarSpec::JsonSchema(square)).contains("minProperties"));
        let mut deep = json!({"type": "string"});
        for _ in 0..MAX_DEPTH {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(refused(&GrammarSpec::JsonSchema(deep)).contains("nested"));
        let enums = json!({"enum": vec![json!("x"); MAX_ENUM_VALUES + 1]});
        assert!(refused(&GrammarSpec::JsonSchema(enums)).contains("enum"));
        let pattern = json!({"type": "string", "pattern": "a".repeat(MAX_PATTERN_BYTES + 1)});
        assert!(refused(&GrammarSpec::JsonSchema(pattern)).contains("pattern"));
        let ws = json!({"x-guidance": {"whitespace_pattern": "b".repeat(MAX_PATTERN_BYTES + 1)}});
        assert!(refused(&GrammarSpec::JsonSchema(ws)).contains("pattern"));
        let pp = json!({"patternProperties": {"c".repeat(MAX_PATTERN_BYTES + 1): {}}});
        assert!(refused(&GrammarSpec::JsonSchema(pp)).contains("pattern"));
        let alts = json!({"anyOf": vec![json!({}); MAX_ALTERNATIVES + 1]});
        assert!(refused(&GrammarSpec::JsonSchema(alts)).contains("alternatives"));
        let two = |n: usize| {
            json!({"properties": {
                "a": {"properties": props(n), "minProperties": 1},
                "b": {"properties": props(n), "minProperties": 1}}})
        };
        check(&GrammarSpec::JsonSchema(two(90))).unwrap();
        assert!(refused(&GrammarSpec::JsonSchema(two(91))).contains("n x n"));
        let big = json!({"description": "d".repeat(MAX_SPEC_BYTES)});
        assert!(refused(&GrammarSpec::JsonSchema(big)).contains("bytes"));
        let many = GrammarSpec::ToolCalls {
            tools: (0..=MAX_TOOLS)
                .map(|i| (format!("t{i}"), Value::Null))
                .collect(),
            parallel: true,
        };
        assert!(refused(&many).contains("tools"));
        // Counted over all tools together.
        let split = GrammarSpec::ToolCalls {
            tools: (0..4)
                .map(|i| {
                    (
                        format!("t{i}"),
                        json!({"properties": props(MAX_PROPERTIES / 2)}),
                    )
                })
                .collect(),
            parallel: true,
        };
        assert!(refused(&split).contains("properties"));
    }

    /// `places` objects that each merge `minProperties` with one
    /// definition of `n` properties (no property besides them allowed),
    /// in the way `how` names: `ref` (a `$ref` beside `minProperties`),
    /// `allof` (an `allOf` of the `$ref` and `minProperties`), `anyof`
    /// (alternatives beside `minProperties`, two each).
    fn merged_tables(places: usize, n: usize, how: &str) -> Value {
        let r = json!({"$ref": "#/$defs/t"});
        let place = match how {
            "ref" => json!({"$ref": "#/$defs/t", "minProperties": 1}),
            "allof" => json!({"allOf": [r, {"minProperties": 1}]}),
            "anyof" => json!({"anyOf": [r, r], "minProperties": 1}),
            _ => unreachable!(),
        };
        let places: Map<String, Value> = (0..places)
            .map(|i| (format!("a{i}"), place.clone()))
            .collect();
        json!({"$defs": {"t": {"type": "object", "properties": props(n),
            "additionalProperties": false}},
            "type": "object", "properties": places})
    }

    /// The issue's schema: 64 places that each add `minProperties` to one
    /// 128-property definition through `$ref` are 64 tables, refused by
    /// the cells bound before any compile; so through `allOf` and beside
    /// alternatives. One such place is one table, as written in place.
    #[test]
    fn tables_merged_through_ref_and_allof_are_counted_at_each_place() {
        for how in ["ref", "allof", "anyof"] {
            let m = refused(&GrammarSpec::JsonSchema(merged_tables(
                64,
                MAX_COUNTED_PROPERTIES,
                how,
            )));
            assert!(
                m.contains("minProperties/maxProperties tables"),
                "{how}: {m}"
            );
            let tools = GrammarSpec::ToolCalls {
                tools: vec![("f".into(), merged_tables(64, MAX_COUNTED_PROPERTIES, how))],
                parallel: false,
            };
            assert!(refused(&tools).starts_with("tools: too large"), "{how}");
            // Two places of 90 fit, as two objects of 90 written in place.
            let alternatives = if how == "anyof" { 2 } else { 1 };
            let fits = (MAX_COUNTED_CELLS / 2 / alternatives).isqrt();
            check(&GrammarSpec::JsonSchema(merged_tables(2, fits, how))).unwrap();
            let m = refused(&GrammarSpec::JsonSchema(merged_tables(2, fits + 1, how)));
            assert!(m.contains("n x n"), "{how}: {m}");
            // One place past the per-object bound.
            let m = refused(&GrammarSpec::JsonSchema(merged_tables(
                1,
                MAX_COUNTED_PROPERTIES + 1,
                how,
            )));
            assert!(m.contains("minProperties"), "{how}: {m}");
        }
        // A plain reference (annotations beside it) is compiled once: the
        // definition's own table counts, not each reference to it.
        let defined = json!({"$defs": {"t": {"properties": props(MAX_COUNTED_PROPERTIES),
            "minProperties": 1, "additionalProperties": false}},
            "properties": (0..64).map(|i| (format!("a{i}"),
                json!({"$ref": "#/$defs/t", "description": "d"}))).collect::<Map<_, _>>()});
        check(&GrammarSpec::JsonSchema(defined)).unwrap();
    }

    /// What the merged bound admits compiles: one 128-property table
    /// through `$ref`.
    #[test]
    fn a_table_merged_through_ref_at_the_bound_compiles() {
        use crate::grammar::Grammars;
        use crate::tokenizer::testing::tiny_metadata;
        use crate::tokenizer::TextTokenizer;
        let tok = TextTokenizer::from_gguf_metadata(&tiny_metadata()).unwrap();
        let grammars = Grammars::new(&tok, tok.vocab_size()).unwrap();
        let spec = GrammarSpec::JsonSchema(merged_tables(1, MAX_COUNTED_PROPERTIES, "ref"));
        assert!(grammars.compile(&spec).is_ok());
    }

    /// The alternatives of `allOf`s are summed over the spec: each at the
    /// bound passes alone, two together do not.
    #[test]
    fn allof_alternatives_are_summed_over_the_spec() {
        let fits = MAX_ALLOF_PRODUCT.ilog2() as usize;
        let two = json!({"properties": {"x": allof_of_anyofs(fits, false),
            "y": allof_of_anyofs(fits, false)}});
        let m = refused(&GrammarSpec::JsonSchema(two));
        assert!(m.contains("allOf alternatives in all"), "{m}");
        let halves = json!({"properties": {"x": allof_of_anyofs(fits - 1, false),
            "y": allof_of_anyofs(fits - 1, false)}});
        check(&GrammarSpec::JsonSchema(halves)).unwrap();
    }
}
