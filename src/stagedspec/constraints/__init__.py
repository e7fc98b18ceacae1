"""Structured output and logit controls that stay exact under speculation.

- `logit_bias`: `stagedspec.constraints.logit_bias`;
- grammars (JSON schema, any JSON object, Lark / GBNF): `stagedspec.constraints.grammar` (llguidance, optional);
- how both reach every row that becomes p or q: `stagedspec.constraints.processor`.
"""

from stagedspec.constraints.grammar import GrammarCompiler, GrammarSpec, grammar_available
from stagedspec.constraints.logit_bias import parse_logit_bias
from stagedspec.constraints.processor import ConstrainedOracle, LogitControls, LogitsProcessor, build_processor

__all__ = ["ConstrainedOracle", "GrammarCompiler", "GrammarSpec", "LogitControls", "LogitsProcessor",
           "build_processor", "grammar_available", "parse_logit_bias"]
