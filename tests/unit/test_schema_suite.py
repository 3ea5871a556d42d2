"""A suite of JSON Schemas shaped like real APIs' (tool parameters, webhook payloads, records,
configs), each with instances it allows and instances it does not, run through the grammar a
`json` constraint compiles (strict, and not strict: `"x-strict": false`):

- jsonschema agrees with the suite about every instance (the data is right);
- the grammar takes every valid instance (the strict one as it writes JSON, in the schema's key
  order; the other pretty-printed, and with an extra key where the schema allows one) and refuses
  every invalid one, however it is written;
- outputs sampled from the grammar (seeded walks over a byte vocabulary, no model) validate;
- a schema that uses a keyword the grammar cannot enforce is refused by name.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import xgrammar

from backend.core.grammar_compiler import GrammarCompiler
from backend.errors import ValidationError
from tests.conftest import _byte_tokenizer
from tests.unit.test_json_schema import EOS, accepts

S = {"type": "string"}
I = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}
SHORT = {"type": "string", "maxLength": 24}
ID = {"type": "string", "pattern": "^[a-z]{2,4}_[A-Za-z0-9]{6,12}$"}
UUID = {"type": "string", "format": "uuid"}
EMAIL = {"type": "string", "format": "email"}
DATE = {"type": "string", "format": "date"}
DATETIME = {"type": "string", "format": "date-time"}
URI = {"type": "string", "format": "uri"}


def obj(properties: dict, required: list | None = None, **more) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            **more}


ADDRESS = obj({"line1": SHORT, "city": SHORT, "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
               "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}, ["line1", "city", "country"])
MONEY = obj({"amount": {"type": "integer", "minimum": 0}, "currency": {"enum": ["usd", "eur", "gbp"]}})
LINE_ITEM = obj({"sku": ID, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}, "price": MONEY})
POINT = {"type": "array", "prefixItems": [{"type": "number", "minimum": -180, "maximum": 180},
                                          {"type": "number", "minimum": -90, "maximum": 90}],
         "items": False, "minItems": 2}
TREE = {"$defs": {"node": obj({"name": SHORT, "children": {"type": "array", "maxItems": 3,
                                                           "items": {"$ref": "#/$defs/node"}}}, ["name"])},
        "$ref": "#/$defs/node"}
CARD = obj({"type": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
            "exp_month": {"type": "integer", "minimum": 1, "maximum": 12}})
BANK = obj({"type": {"const": "bank"}, "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,20}$"}})
EVENT = {"oneOf": [obj({"event": {"const": "created"}, "id": ID}),
                   obj({"event": {"const": "deleted"}, "id": ID, "reason": SHORT}, ["event", "id"])]}

# name -> (schema, valid instances in the schema's key order, invalid instances)
SUITE: dict[str, tuple[dict, list, list]] = {
    "weather_tool": (obj({"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}),
                     [{"city": "Paris", "unit": "celsius"}], [{"city": "Paris"}, {"city": "Paris", "unit": "kelvin"}]),
    "search_tool": (obj({"query": {"type": "string", "minLength": 1, "maxLength": 80},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 50}}, ["query"]),
                    [{"query": "llm serving"}, {"query": "x", "limit": 50}], [{"query": ""}, {"query": "x", "limit": 0}]),
    "calculator_tool": (obj({"expression": {"type": "string", "pattern": "^[0-9+*/() .-]+$"}}),
                        [{"expression": "(1 + 2) * 3"}], [{"expression": "import os"}]),
    "send_email_tool": (obj({"to": {"type": "array", "items": EMAIL, "minItems": 1, "maxItems": 5}, "subject": SHORT,
                             "body": S}), [{"to": ["a@b.co"], "subject": "Hi", "body": "Text"}],
                        [{"to": [], "subject": "Hi", "body": ""}, {"to": ["not-an-email"], "subject": "Hi", "body": ""}]),
    "translate_tool": (obj({"text": S, "source": {"type": "string", "pattern": "^[a-z]{2}$"},
                            "target": {"type": "string", "pattern": "^[a-z]{2}$"}}, ["text", "target"]),
                       [{"text": "bonjour", "target": "en"}], [{"text": "x", "target": "eng"}]),
    "sql_tool": (obj({"query": {"type": "string", "pattern": "^SELECT "}, "timeout_s": {"type": "number",
                                                                                         "exclusiveMinimum": 0}}),
                 [{"query": "SELECT 1", "timeout_s": 1.5}], [{"query": "DROP TABLE x", "timeout_s": 1},
                                                              {"query": "SELECT 1", "timeout_s": 0}]),
    "calendar_event": (obj({"title": SHORT, "start": DATETIME, "end": DATETIME,
                            "attendees": {"type": "array", "items": EMAIL, "maxItems": 4}}, ["title", "start"]),
                       [{"title": "Sync", "start": "2024-05-01T10:00:00Z", "attendees": ["a@b.co"]}],
                       [{"title": "Sync", "start": "May 1st"}, {"start": "2024-05-01T10:00:00Z"}]),
    "address": (ADDRESS, [{"line1": "1 Main St", "city": "Springfield", "postal_code": "12345", "country": "US"}],
                [{"line1": "1 Main St", "city": "X", "country": "USA"}, {"line1": "1", "city": "X",
                                                                          "postal_code": "1234", "country": "US"}]),
    "person": (obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": EMAIL},
                   ["name", "age"]), [{"name": "Ada", "age": 36}, {"name": "Ada", "age": 36, "email": "a@b.co"}],
               [{"name": "Ada", "age": -1}, {"name": "Ada", "age": 36.5}, {"name": "Ada"}]),
    "product": (obj({"id": ID, "name": SHORT, "price": MONEY, "tags": {"type": "array", "items": SHORT, "maxItems": 5},
                     "in_stock": B}, ["id", "name", "price"]),
                [{"id": "prod_ABC123", "name": "Lamp", "price": {"amount": 1999, "currency": "usd"}, "in_stock": True}],
                [{"id": "p1", "name": "Lamp", "price": {"amount": 1999, "currency": "usd"}},
                 {"id": "prod_ABC123", "name": "Lamp", "price": {"amount": -1, "currency": "usd"}}]),
    "order": (obj({"id": ID, "items": {"type": "array", "items": LINE_ITEM, "minItems": 1, "maxItems": 3},
                   "shipping": ADDRESS, "status": {"enum": ["pending", "paid", "shipped"]}}),
              [{"id": "ord_123456", "items": [{"sku": "sku_AAAAAA", "quantity": 2, "price": {"amount": 5,
                                                                                             "currency": "eur"}}],
                "shipping": {"line1": "x", "city": "y", "country": "FR"}, "status": "paid"}],
              [{"id": "ord_123456", "items": [], "shipping": {"line1": "x", "city": "y", "country": "FR"},
                "status": "paid"}]),
    "invoice": (obj({"number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"}, "issued": DATE, "due": DATE,
                     "total": MONEY, "paid": B}),
                [{"number": "INV-0042", "issued": "2024-01-01", "due": "2024-02-01",
                  "total": {"amount": 100, "currency": "gbp"}, "paid": False}],
                [{"number": "INV-42", "issued": "2024-01-01", "due": "2024-02-01",
                  "total": {"amount": 100, "currency": "gbp"}, "paid": False}]),
    "payment_method_oneOf": ({"oneOf": [CARD, BANK]},
                             [{"type": "card", "last4": "4242", "exp_month": 12}, {"type": "bank", "iban": "DE89370400440532"}],
                             [{"type": "card", "iban": "DE89370400440532"}, {"type": "cash"}]),
    "webhook_event_oneOf": (EVENT, [{"event": "created", "id": "evt_ABCDEF"},
                                    {"event": "deleted", "id": "evt_ABCDEF", "reason": "spam"}],
                            [{"event": "updated", "id": "evt_ABCDEF"}]),
    "github_issue": (obj({"number": {"type": "integer", "minimum": 1}, "title": SHORT,
                          "state": {"enum": ["open", "closed"]},
                          "labels": {"type": "array", "items": obj({"name": SHORT, "color": {
                              "type": "string", "pattern": "^[0-9a-f]{6}$"}}), "maxItems": 3},
                          "assignee": {"type": ["string", "null"]}}),
                     [{"number": 62, "title": "Schemas", "state": "open",
                       "labels": [{"name": "bug", "color": "d73a4a"}], "assignee": None}],
                     [{"number": 0, "title": "x", "state": "open", "labels": [], "assignee": None},
                      {"number": 1, "title": "x", "state": "merged", "labels": [], "assignee": None}]),
    "slack_message": (obj({"channel": {"type": "string", "pattern": "^C[A-Z0-9]{8}$"}, "text": S,
                           "thread_ts": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"}}, ["channel", "text"]),
                      [{"channel": "C12345678", "text": "hello"}], [{"channel": "general", "text": "hello"}]),
    "json_rpc_request": (obj({"jsonrpc": {"const": "2.0"}, "method": SHORT,
                              "params": {"type": "array", "maxItems": 3}, "id": {"anyOf": [I, S]}}),
                         [{"jsonrpc": "2.0", "method": "sum", "params": [1, 2], "id": 1}],
                         [{"jsonrpc": "1.0", "method": "sum", "params": [], "id": 1},
                          {"jsonrpc": "2.0", "method": "sum", "params": [], "id": None}]),
    "geojson_point": (obj({"type": {"const": "Point"}, "coordinates": POINT}),
                      [{"type": "Point", "coordinates": [2.35, 48.85]}],
                      [{"type": "Point", "coordinates": [200, 0]}, {"type": "Point", "coordinates": [1, 2, 3]}]),
    "geojson_feature": (obj({"type": {"const": "Feature"}, "geometry": obj({"type": {"const": "Point"},
                                                                           "coordinates": POINT}),
                             "properties": {"type": "object", "additionalProperties": S}}),
                        [{"type": "Feature", "geometry": {"type": "Point", "coordinates": [0, 0]},
                          "properties": {"name": "origin"}}],
                        [{"type": "Feature", "geometry": {"type": "Point", "coordinates": [0, 0]},
                          "properties": {"name": 1}}]),
    "category_tree": (TREE, [{"name": "root", "children": [{"name": "leaf", "children": []}]}],
                      [{"name": "root", "children": [{"children": []}]}]),
    "comment_thread": ({"$defs": {"c": obj({"author": SHORT, "body": S, "replies": {"type": "array", "maxItems": 2,
                                                                                   "items": {"$ref": "#/$defs/c"}}},
                                           ["author", "body"])}, "type": "array", "items": {"$ref": "#/$defs/c"},
                        "maxItems": 2},
                       [[{"author": "a", "body": "hi", "replies": [{"author": "b", "body": "yo"}]}]],
                       [[{"author": "a"}]]),
    "matrix": ({"type": "array", "items": {"type": "array", "items": N, "minItems": 2, "maxItems": 2},
                "minItems": 2, "maxItems": 2}, [[[1, 0], [0, 1.5]]], [[[1, 0]], [[1, 0], [0]]]),
    "rgb_color": (obj({"hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
                       "alpha": {"type": "number", "minimum": 0, "maximum": 1}}),
                  [{"hex": "#FFAA00", "alpha": 0.5}], [{"hex": "FFAA00", "alpha": 0.5}, {"hex": "#FFAA00", "alpha": 2}]),
    "phone_contact": (obj({"name": SHORT, "phone": {"type": "string", "pattern": "^\\+[1-9][0-9]{7,14}$"}}),
                      [{"name": "Bo", "phone": "+14155550100"}], [{"name": "Bo", "phone": "555-0100"}]),
    "price_in_cents": (obj({"cents": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 1000}}),
                       [{"cents": 995}], [{"cents": 999}, {"cents": 9.95}, {"cents": 1005}]),
    "rating": (obj({"stars": {"enum": [1, 2, 3, 4, 5]}, "review": {"type": "string", "maxLength": 140}}, ["stars"]),
               [{"stars": 4}, {"stars": 5, "review": "Great"}], [{"stars": 6}, {"stars": "5"}]),
    "feature_flags": ({"type": "object", "additionalProperties": B, "maxProperties": 5},
                      [{"dark_mode": True, "beta": False}], [{"dark_mode": "yes"}]),
    "i18n_strings": ({"type": "object", "patternProperties": {"^[a-z]{2}$": S}, "additionalProperties": False,
                      "minProperties": 1}, [{"en": "Hello", "fr": "Bonjour"}], [{"english": "Hello"}, {}]),
    "pagination": (obj({"data": {"type": "array", "items": obj({"id": I})}, "has_more": B,
                        "next_cursor": {"type": ["string", "null"]}}),
                   [{"data": [{"id": 1}], "has_more": False, "next_cursor": None}],
                   [{"data": [{"id": "1"}], "has_more": False, "next_cursor": None}]),
    "error_response": (obj({"error": obj({"code": {"type": "integer", "minimum": 400, "maximum": 599},
                                          "message": S, "details": {"type": "array", "items": S}}, ["code", "message"])}),
                       [{"error": {"code": 404, "message": "not found"}}], [{"error": {"code": 200, "message": "ok"}}]),
    "log_entry": (obj({"ts": DATETIME, "level": {"enum": ["debug", "info", "warn", "error"]}, "msg": S,
                       "fields": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}},
                      ["ts", "level", "msg"]),
                  [{"ts": "2024-01-01T00:00:00Z", "level": "info", "msg": "up", "fields": {"port": 8000}}],
                  [{"ts": "2024-01-01T00:00:00Z", "level": "trace", "msg": "up"}]),
    "metric_sample": (obj({"name": {"type": "string", "pattern": "^[a-z_:][a-z0-9_:]*$"}, "value": N,
                           "labels": {"type": "object", "additionalProperties": S}}),
                      [{"name": "http_requests_total", "value": 42, "labels": {"code": "200"}}],
                      [{"name": "HTTP Requests", "value": 42, "labels": {}}]),
    "k8s_container": (obj({"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"},
                           "image": SHORT, "ports": {"type": "array", "maxItems": 2, "items": obj({
                               "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                               "protocol": {"enum": ["TCP", "UDP"]}}, ["containerPort"])}}, ["name", "image"]),
                      [{"name": "web", "image": "nginx:1.25", "ports": [{"containerPort": 80, "protocol": "TCP"}]}],
                      [{"name": "Web", "image": "nginx"}, {"name": "web", "image": "x", "ports": [{"containerPort": 0}]}]),
    "package_manifest": (obj({"name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,30}$"},
                              "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
                              "dependencies": {"type": "object", "additionalProperties": SHORT}}, ["name", "version"]),
                         [{"name": "left-pad", "version": "1.3.0", "dependencies": {}}],
                         [{"name": "left-pad", "version": "1.3"}]),
    "ci_job": (obj({"runs_on": {"enum": ["ubuntu-latest", "macos-latest"]}, "timeout_minutes": {
        "type": "integer", "minimum": 1, "maximum": 360}, "steps": {"type": "array", "minItems": 1, "maxItems": 3,
                                                                   "items": {"anyOf": [obj({"run": SHORT}),
                                                                                       obj({"uses": SHORT})]}}}),
               [{"runs_on": "ubuntu-latest", "timeout_minutes": 30, "steps": [{"uses": "checkout"}, {"run": "make"}]}],
               [{"runs_on": "windows", "timeout_minutes": 30, "steps": [{"run": "make"}]},
                {"runs_on": "ubuntu-latest", "timeout_minutes": 30, "steps": [{"shell": "bash"}]}]),
    "compose_service": (obj({"image": SHORT, "environment": {"type": "object", "additionalProperties": S},
                             "restart": {"enum": ["no", "always", "on-failure"]}}, ["image"]),
                        [{"image": "redis", "environment": {"A": "1"}, "restart": "always"}],
                        [{"image": "redis", "restart": "sometimes"}]),
    "oauth_token": (obj({"access_token": S, "token_type": {"const": "Bearer"}, "expires_in": {"type": "integer",
                                                                                               "minimum": 0},
                         "scope": S}, ["access_token", "token_type"]),
                    [{"access_token": "abc", "token_type": "Bearer", "expires_in": 3600}],
                    [{"access_token": "abc", "token_type": "MAC"}]),
    "jwt_claims": (obj({"sub": S, "iat": {"type": "integer", "minimum": 0}, "exp": {"type": "integer", "minimum": 0},
                        "aud": {"anyOf": [S, {"type": "array", "items": S}]}}, ["sub", "exp"]),
                   [{"sub": "u1", "iat": 1, "exp": 2, "aud": ["api"]}], [{"sub": "u1", "exp": -5}]),
    "s3_object": (obj({"key": {"type": "string", "minLength": 1, "maxLength": 64}, "size": {"type": "integer",
                                                                                             "minimum": 0},
                       "etag": {"type": "string", "pattern": "^[0-9a-f]{32}$"}, "last_modified": DATETIME}),
                  [{"key": "a/b.txt", "size": 3, "etag": "0" * 32, "last_modified": "2024-01-01T00:00:00Z"}],
                  [{"key": "", "size": 3, "etag": "0" * 32, "last_modified": "2024-01-01T00:00:00Z"}]),
    "rss_item": (obj({"title": SHORT, "link": URI, "pub_date": DATETIME, "guid": UUID}, ["title", "link"]),
                 [{"title": "News", "link": "https://example.com/a", "guid": "123e4567-e89b-12d3-a456-426614174000"}],
                 [{"title": "News", "link": "not a link"}]),
    "sensor_reading": (obj({"sensor_id": UUID, "temperature_c": {"type": "number", "minimum": -50, "maximum": 150},
                            "humidity": {"type": "number", "minimum": 0, "maximum": 100}}),
                       [{"sensor_id": "123e4567-e89b-12d3-a456-426614174000", "temperature_c": 21.5, "humidity": 40}],
                       [{"sensor_id": "x", "temperature_c": 21.5, "humidity": 40},
                        {"sensor_id": "123e4567-e89b-12d3-a456-426614174000", "temperature_c": 200, "humidity": 40}]),
    "bank_transaction": (obj({"id": ID, "amount": {"type": "integer"}, "direction": {"enum": ["debit", "credit"]},
                              "booked": DATE, "counterparty": {"type": ["string", "null"], "maxLength": 24}}),
                         [{"id": "txn_ABCDEF", "amount": 100, "direction": "debit", "booked": "2024-03-01",
                           "counterparty": None}],
                         [{"id": "txn_ABCDEF", "amount": 1.5, "direction": "debit", "booked": "2024-03-01",
                           "counterparty": None}]),
    "flight_booking": (obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string",
                                                                                     "pattern": "^[A-Z]{3}$"},
                            "date": DATE, "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                            "cabin": {"enum": ["economy", "business", "first"]}}, ["from", "to", "date"]),
                       [{"from": "CDG", "to": "JFK", "date": "2024-07-01", "passengers": 2}],
                       [{"from": "Paris", "to": "JFK", "date": "2024-07-01"}]),
    "hotel_search": (obj({"city": SHORT, "check_in": DATE, "nights": {"type": "integer", "minimum": 1, "maximum": 30},
                          "max_price": {"type": "number", "exclusiveMinimum": 0}}, ["city", "check_in", "nights"]),
                     [{"city": "Rome", "check_in": "2024-08-10", "nights": 3}],
                     [{"city": "Rome", "check_in": "2024-08-10", "nights": 0}]),
    "forecast": ({"type": "array", "minItems": 1, "maxItems": 3, "items": obj({"day": DATE, "high": N, "low": N,
                                                                               "sky": {"enum": ["sun", "cloud", "rain"]}})},
                 [[{"day": "2024-01-01", "high": 10, "low": 2.5, "sky": "sun"}]],
                 [[], [{"day": "2024-01-01", "high": 10, "low": 2, "sky": "snow"}]]),
    "stock_quote": (obj({"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"}, "price": {"type": "number",
                                                                                         "minimum": 0},
                         "change_pct": N}), [{"symbol": "NVDA", "price": 120.5, "change_pct": -1.2}],
                    [{"symbol": "nvda", "price": 1, "change_pct": 0}]),
    "recipe": (obj({"title": SHORT, "servings": {"type": "integer", "minimum": 1}, "ingredients": {
        "type": "array", "minItems": 1, "maxItems": 4, "items": obj({"item": SHORT, "grams": {"type": "number",
                                                                                            "minimum": 0}})},
                    "vegan": B}), [{"title": "Soup", "servings": 2, "ingredients": [{"item": "leek", "grams": 200}],
                                    "vegan": True}],
               [{"title": "Soup", "servings": 2, "ingredients": [], "vegan": True}]),
    "movie": (obj({"title": SHORT, "year": {"type": "integer", "minimum": 1888, "maximum": 2100},
                   "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror", "sci-fi"]},
                              "maxItems": 3}}), [{"title": "Alien", "year": 1979, "genres": ["horror", "sci-fi"]}],
              [{"title": "Alien", "year": 1700, "genres": []}]),
    "book": (obj({"isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"}, "title": SHORT,
                  "authors": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
             [{"isbn": "9780262033848", "title": "CLRS", "authors": ["Cormen"]}],
             [{"isbn": "12345", "title": "CLRS", "authors": ["Cormen"]}]),
    "survey_answer_anyOf": (obj({"question": I, "answer": {"anyOf": [B, {"type": "integer", "minimum": 1,
                                                                          "maximum": 5}, SHORT]}}),
                            [{"question": 1, "answer": True}, {"question": 2, "answer": 4}],
                            [{"question": 1, "answer": None}]),
    "todo_list": (obj({"items": {"type": "array", "maxItems": 3, "items": obj({"text": SHORT, "done": B,
                                                                               "due": {"type": ["string", "null"],
                                                                                       "format": "date"}})}}),
                  [{"items": [{"text": "buy milk", "done": False, "due": None}]}],
                  [{"items": [{"text": "buy milk", "done": "no", "due": None}]}]),
    "kanban_card": (obj({"title": SHORT, "column": {"enum": ["todo", "doing", "done"]},
                         "points": {"type": "integer", "multipleOf": 1, "minimum": 0, "maximum": 13}}),
                    [{"title": "Fix", "column": "doing", "points": 3}], [{"title": "Fix", "column": "later", "points": 3}]),
    "openapi_parameter": (obj({"name": SHORT, "in": {"enum": ["query", "header", "path", "cookie"]}, "required": B,
                               "schema": obj({"type": {"enum": ["string", "integer", "boolean"]}})},
                              ["name", "in"]),
                          [{"name": "limit", "in": "query", "required": False, "schema": {"type": "integer"}}],
                          [{"name": "limit", "in": "body"}]),
    "dns_record": ({"oneOf": [obj({"type": {"const": "A"}, "value": {"type": "string", "format": "ipv4"}}),
                              obj({"type": {"const": "AAAA"}, "value": {"type": "string", "format": "ipv6"}}),
                              obj({"type": {"const": "CNAME"}, "value": {"type": "string", "format": "hostname"}})]},
                   [{"type": "A", "value": "10.0.0.1"}, {"type": "CNAME", "value": "example.com"}],
                   [{"type": "A", "value": "example.com"}, {"type": "MX", "value": "mx.example.com"}]),
    "ip_allowlist": (obj({"cidrs": {"type": "array", "items": {"type": "string", "format": "ipv4"}, "maxItems": 4}}),
                     [{"cidrs": ["10.0.0.1", "192.168.1.1"]}], [{"cidrs": ["10.0.0"]}]),
    "http_request": (obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]}, "url": URI,
                          "headers": {"type": "object", "additionalProperties": S}}, ["method", "url"]),
                     [{"method": "GET", "url": "https://api.example.com/v1/x", "headers": {"Accept": "json"}}],
                     [{"method": "FETCH", "url": "https://api.example.com"}]),
    "chat_message": (obj({"role": {"enum": ["system", "user", "assistant"]}, "content": S,
                          "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}}, ["role", "content"]),
                     [{"role": "user", "content": "hi"}], [{"role": "robot", "content": "hi"}]),
    "file_upload": (obj({"filename": {"type": "string", "pattern": "^[a-z0-9_-]{1,32}\\.(png|jpg|pdf)$"},
                         "bytes": {"type": "integer", "minimum": 1, "maximum": 10000000}}),
                    [{"filename": "scan.pdf", "bytes": 2048}], [{"filename": "scan.exe", "bytes": 2048}]),
    "medical_observation": (obj({"code": {"type": "string", "pattern": "^[0-9]{4,5}-[0-9]$"}, "value": N,
                                 "unit": {"enum": ["mg/dL", "mmol/L"]}, "effective": DATETIME}),
                            [{"code": "2345-7", "value": 5.4, "unit": "mmol/L", "effective": "2024-01-01T08:00:00Z"}],
                            [{"code": "glucose", "value": 5.4, "unit": "mmol/L", "effective": "2024-01-01T08:00:00Z"}]),
    "tax_form": ({"allOf": [obj({"year": {"type": "integer", "minimum": 2000}}),
                            obj({"income": {"type": "integer", "minimum": 0}}),
                            {"properties": {"year": {"maximum": 2030}}}]},
                 [{"year": 2023, "income": 50000}], [{"year": 2040, "income": 1}, {"year": 2023}]),
    "user_with_defs": ({"$defs": {"email": EMAIL, "role": {"enum": ["admin", "member"]}},
                        "type": "object", "properties": {"email": {"$ref": "#/$defs/email"},
                                                         "roles": {"type": "array", "items": {"$ref": "#/$defs/role"},
                                                                   "maxItems": 2}},
                        "required": ["email", "roles"]},
                       [{"email": "a@b.co", "roles": ["admin"]}], [{"email": "a@b.co", "roles": ["owner"]}]),
    "pydantic_optional": ({"type": "object", "title": "Model", "properties": {
        "name": {"title": "Name", "type": "string"},
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Nickname"}},
        "required": ["name"]}, [{"name": "a"}, {"name": "a", "nickname": None}], [{"nickname": "b"}]),
    "pydantic_ref_with_description": ({"$defs": {"Addr": ADDRESS}, "type": "object", "properties": {
        "home": {"$ref": "#/$defs/Addr", "description": "Where the user lives"}}, "required": ["home"]},
        [{"home": {"line1": "1 Main", "city": "X", "country": "US"}}], [{"home": {"line1": "1 Main"}}]),
    "draft07_tuple": ({"type": "array", "items": [S, I], "additionalItems": False},
                      [["a", 1]], [["a", "b"], ["a", 1, 2]]),
    "at_least_one_contact": ({"type": "object", "properties": {"email": EMAIL, "phone": SHORT},
                              "anyOf": [{"required": ["email"]}, {"required": ["phone"]}]},
                             [{"email": "a@b.co"}, {"phone": "555"}], [{}]),
    "strict_record": (obj({"id": I, "note": SHORT}, additionalProperties=False),
                      [{"id": 1, "note": "x"}], [{"id": 1, "note": "x", "extra": True}]),
    "nested_config": (obj({"server": obj({"host": {"type": "string", "format": "hostname"},
                                          "port": {"type": "integer", "minimum": 1, "maximum": 65535}}),
                           "tls": obj({"enabled": B, "cert_path": SHORT}, ["enabled"])}),
                      [{"server": {"host": "localhost", "port": 8000}, "tls": {"enabled": False}}],
                      [{"server": {"host": "localhost", "port": 0}, "tls": {"enabled": False}}]),
    "semver_release": (obj({"tag": {"type": "string", "pattern": "^v[0-9]+\\.[0-9]+\\.[0-9]+(-rc[0-9]+)?$"},
                            "date": DATE, "prerelease": B}),
                       [{"tag": "v1.2.3-rc1", "date": "2024-02-02", "prerelease": True}],
                       [{"tag": "1.2.3", "date": "2024-02-02", "prerelease": True}]),
}

# real-API shapes that use a keyword the grammar cannot enforce: refused, naming it
UNSUPPORTED = {
    "uniqueItems": obj({"tags": {"type": "array", "items": S, "uniqueItems": True}}),
    "contains": obj({"roles": {"type": "array", "items": S, "contains": {"const": "owner"}}}),
    "dependentRequired": obj({"card": S, "cvv": S}, [], dependentRequired={"card": ["cvv"]}),
    "if": obj({"country": S, "state": S}, ["country"], **{"if": {"properties": {"country": {"const": "US"}}},
                                                         "then": {"required": ["state"]}}),
    "not": obj({"username": {"type": "string", "not": {"enum": ["admin", "root"]}}}),
    "oneOf": {"oneOf": [obj({"id": I}), obj({"id": I, "name": S})]},
    "allOf": {"allOf": [{"type": "string", "format": "email"}, {"format": "hostname"}]},
    "$ref": obj({"address": {"$ref": "https://schemas.example.com/address.json"}}),
    "multipleOf": obj({"price": {"type": "number", "multipleOf": 0.01}}),
}


def pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(_byte_tokenizer(), 259, (EOS,))


def compiled(grammars, schema, strict: bool) -> xgrammar.CompiledGrammar:
    return grammars.compile({"json": json.dumps(schema if strict else {**schema, "x-strict": False})})


def validator(schema) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if "additionalItems" in json.dumps(schema):
        cls = jsonschema.Draft7Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_the_suite_is_large_and_its_instances_are_what_it_says():
    """jsonschema checks the formats it has a checker for here (date-time, uri and hostname need
    optional packages): an instance that breaks only one of the others is the grammar's to refuse."""
    assert len(SUITE) >= 60
    for name, (schema, valid, invalid) in SUITE.items():
        check = validator(schema)
        assert valid and invalid, name
        for value in valid:
            assert check.is_valid(value), (name, value)
        unchecked = set(re.findall(r'"format": "([a-z0-9-]+)"', json.dumps(schema))) - set(check.format_checker.checkers)
        for value in invalid:
            assert not check.is_valid(value) or unchecked, (name, value)


@pytest.mark.parametrize("name", SUITE)
def test_the_grammar_takes_every_valid_instance_and_refuses_every_invalid_one(grammars, name):
    schema, valid, invalid = SUITE[name]
    strict, free = compiled(grammars, schema, True), compiled(grammars, schema, False)
    for value in valid:
        assert accepts(strict, json.dumps(value, ensure_ascii=False)), value
        assert accepts(free, pretty(value)) and accepts(free, compact(value)), value
    for value in invalid:
        for grammar in (strict, free):
            assert not any(accepts(grammar, text) for text in (json.dumps(value), pretty(value), compact(value))), value


@pytest.mark.parametrize("name", [n for n, (s, _, _) in SUITE.items() if s.get("type") == "object"
                                  and "additionalProperties" not in s and "properties" in s])
def test_not_strict_takes_a_key_beyond_the_schemas_where_it_allows_one(grammars, name):
    schema, valid, _ = SUITE[name]
    extra = {**valid[0], "zz_extra": [1, {"a": None}]}
    assert validator(schema).is_valid(extra)
    assert accepts(compiled(grammars, schema, False), pretty(extra))
    assert not accepts(compiled(grammars, schema, True), json.dumps(extra))  # strict: the schema's keys only


CLOSING = frozenset(b'"]},0')


def sample(grammar: xgrammar.CompiledGrammar, rng: random.Random, max_steps: int = 3000) -> str | None:
    """A seeded walk through the grammar over bytes, leaning towards closing what is open; the
    text when the grammar may end, None when the walk runs too long. Byte ED is left out: xgrammar's
    string characters include UTF-16 surrogates (ED A0-BF ..), which are not UTF-8 (a detokenizer
    writes U+FFFD for them)."""
    vocab = grammar.tokenizer_info.decoded_vocab  # token -> its bytes
    closing = np.array([0 if v[:1] == b"\xed" else 20 if v and v[0] in CLOSING else 1 for v in vocab])
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, len(vocab))
    out = bytearray()
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:len(vocab)])
        if EOS in allowed:
            return out.decode("utf-8")
        token = int(rng.choices(allowed, closing[allowed])[0])
        assert matcher.accept_token(token)
        out += vocab[token]
    return None


@pytest.mark.parametrize("name", SUITE)
def test_outputs_sampled_from_the_grammar_validate(grammars, name):
    schema = SUITE[name][0]
    check = validator(schema)
    rng = random.Random(name)
    done = 0
    for strict in (True, False):
        grammar = compiled(grammars, schema, strict)
        for _ in range(3):
            text = sample(grammar, rng)
            if text is not None:
                check.validate(json.loads(text))
                done += 1
    assert done >= 3, name


@pytest.mark.parametrize("keyword", UNSUPPORTED)
def test_a_real_schema_with_an_unsupported_keyword_is_refused_by_name(grammars, keyword):
    for strict in (True, False):
        with pytest.raises(ValidationError) as e:
            compiled(grammars, UNSUPPORTED[keyword], strict)
        assert e.value.field == "guided_decoding"
        assert f"JSON Schema keyword {keyword!r} is not supported" in e.value.message
