"""JSON schemas for the acceptance sweep: nested objects, arrays, enums, required fields,
patterns, numbers with bounds. Strings are short or patterned so that a random-weight model's
output completes within a small token budget."""

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_user": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "active"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "color_list": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "size_enum": {"enum": ["small", "medium", "large"]},
    "code_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "bounded_number": {
        "type": "object",
        "properties": {"t": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["t"],
        "additionalProperties": False,
    },
    "exclusive_integer": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50},
    "nullable": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 3}},
        "required": ["ok", "note"],
        "additionalProperties": False,
    },
    "points": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    "const_and_enum": {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "dim": {"enum": [2, 3]}},
        "required": ["kind", "dim"],
        "additionalProperties": False,
    },
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]},
    "three_levels": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "boolean"}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "tuple": {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
        "items": False,
        "minItems": 2,
    },
    "email_pattern": {"type": "string", "pattern": "^[a-z]{1,3}@[a-z]{1,3}\\.com$"},
    "optional_field": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"type": "string", "maxLength": 2},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "ranked": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 5},
                "minItems": 2,
                "maxItems": 3,
            },
            "level": {"enum": ["low", "high"]},
        },
        "required": ["scores", "level"],
        "additionalProperties": False,
    },
}

# A JSON number has no length limit: a random model may keep adding digits until max_tokens, so
# these schemas may end with "length" every time (their completed samples are still validated).
UNBOUNDED = {"bounded_number"}
