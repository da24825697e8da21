"""JSON Schemas of varied shapes for the structured-output tests and benchmark: nested
objects, required/optional properties, enums and consts, arrays with min/max items,
integer and number ranges, string lengths, patterns and formats, anyOf/oneOf, $ref and
recursive $defs. Strings carry a maxLength where a random model would otherwise wander
(tests/test_structured.py runs them on the random `tiny` model)."""

from __future__ import annotations

import jsonschema

_NAME = {"type": "string", "minLength": 1, "maxLength": 8}
_SHORT = {"type": "string", "maxLength": 6}


def _obj(props: dict, required=None, **extra) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: dict[str, dict] = {
    "flat_required": _obj(
        {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}
    ),
    "optional_fields": _obj(
        {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "note": _SHORT,
            "ok": {"type": "boolean"},
        },
        required=["id"],
    ),
    "all_optional": _obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, required=[]),
    "nested_object": _obj(
        {
            "user": _obj({"name": _NAME, "admin": {"type": "boolean"}}),
            "level": {"type": "integer", "minimum": 1, "maximum": 5},
        }
    ),
    "deeply_nested": _obj(
        {
            "a": _obj(
                {"b": _obj({"c": _obj({"d": {"type": "integer", "minimum": 0, "maximum": 9}})})}
            )
        }
    ),
    "string_enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "mixed_enum": _obj({"v": {"enum": [1, "two", None, True, 3.5]}}),
    "const": _obj(
        {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9, "maximum": 9}}
    ),
    "int_range": _obj({"n": {"type": "integer", "minimum": 10, "maximum": 20}}),
    "negative_range": _obj({"t": {"type": "integer", "minimum": -50, "maximum": -10}}),
    "exclusive_range": _obj(
        {"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}}
    ),
    "number_range": _obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    "array_min_max": _obj(
        {"tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}}
    ),
    "array_exact": _obj(
        {
            "xyz": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 3,
                "maxItems": 3,
            }
        }
    ),
    "array_of_objects": _obj(
        {
            "items": {
                "type": "array",
                "items": _obj({"k": _NAME, "v": {"type": "integer", "minimum": 0, "maximum": 99}}),
                "maxItems": 2,
            }
        }
    ),
    "top_level_array": {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 1,
        "maxItems": 4,
    },
    "array_of_enums": _obj(
        {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}}
    ),
    "string_pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "pattern_alternation": _obj(
        {
            "unit": {"type": "string", "pattern": "^(kg|g|mg)$"},
            "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
        }
    ),
    "string_lengths": _obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "format_date": _obj({"day": {"type": "string", "format": "date"}}),
    "format_email": _obj({"mail": {"type": "string", "format": "email", "maxLength": 12}}),
    "format_ipv4": _obj({"ip": {"type": "string", "format": "ipv4"}}),
    "format_uuid": _obj({"id": {"type": "string", "format": "uuid"}}),
    "any_of": _obj(
        {
            "v": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "boolean"},
                    {"type": "null"},
                ]
            }
        }
    ),
    "any_of_objects": {
        "anyOf": [
            _obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
            _obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}}),
        ]
    },
    "one_of_types": _obj(
        {
            "v": {
                "oneOf": [
                    {"type": "integer", "minimum": 0, "maximum": 9},
                    {"type": "string", "maxLength": 3},
                ]
            }
        }
    ),
    "nullable": _obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "ref": {
        "$defs": {
            "pt": _obj(
                {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                }
            )
        },
        **_obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },
    "recursive_ref": {
        "$defs": {
            "node": _obj(
                {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
                },
                required=["v"],
            )
        },
        "$ref": "#/$defs/node",
    },
    "boolean_only": {"type": "boolean"},
    "bounded_string": {"type": "string", "maxLength": 5},
    "object_with_array_and_enum": _obj(
        {
            "status": {"enum": ["ok", "error"]},
            "codes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 100, "maximum": 599},
                "maxItems": 2,
            },
            "meta": _obj({"retry": {"type": "boolean"}}, required=[]),
        }
    ),
}


def validate(instance, schema: dict) -> None:
    """jsonschema validation with format checks (date, email, ipv4, uuid)."""
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(instance)
