"""Run parameters: one strict pydantic model per stage's section, loaded from YAML plus overrides.

Params files under `params/` are the index of the kinds of run (`embedded.yaml`,
`kimi_sglang.yaml`, `kimi_openrouter.yaml`, `ci.yaml`). Unknown keys are errors, and every
error names the file and the key. `-p key.path value` overrides pass through the same
validation. Secrets never live here: params name the environment variable that holds a key.

One module per section: `base` (strict models, `ParamsError`, `model:`), `generate` (`datasets:`
and `generate:` with its backends), `reconstruct`, `audit`, `hidden` (with the head-position cap
of 04's verification), `export`, `value` (stage 06), and `run` (`RunParams`, which holds them all, and `load_params`).
A new stage's section gets its own module here and one field on `RunParams` (stage 06: `value`).

The names below are the params' public names, imported from here by notebooks, the stages and
users (`from eagle3data.core.params import RunParams, load_params`); each is defined in the
package's own module named beside it, and nothing else is named here.
"""

from eagle3data.core.params.audit import AuditParams
from eagle3data.core.params.base import ModelParams, ParamsError, Strict
from eagle3data.core.params.export import ExportParams
from eagle3data.core.params.generate import (DatasetParams, GenerateParams, OpenAIParams, ProviderRouting,
                                             ReasoningParams, SamplingParams, SGLangParams, VLLMParams, VLLMServerParams)
from eagle3data.core.params.hidden import HiddenParams, HiddenVLLMParams
from eagle3data.core.params.reconstruct import ReconstructParams
from eagle3data.core.params.value import ValueEvalParams, ValueParams, ValueTrainParams
from eagle3data.core.params.run import RunParams, load_params, params_for_display, parse_override, repo_root

__all__ = ["AuditParams", "DatasetParams", "ExportParams", "GenerateParams", "HiddenParams", "HiddenVLLMParams",
           "ModelParams", "OpenAIParams", "ParamsError", "ProviderRouting", "ReasoningParams", "ReconstructParams",
           "RunParams", "SGLangParams", "SamplingParams", "Strict", "VLLMParams", "VLLMServerParams", "ValueEvalParams", "ValueParams",
           "ValueTrainParams", "load_params",
           "params_for_display", "parse_override", "repo_root"]
