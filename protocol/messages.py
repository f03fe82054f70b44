"""Every message on the Xronos control plane: one frozen, strict pydantic model per message.

This module is the one import point of the wire's types (`from xronos.protocol import messages as
m`); the topic table (`topics.py`) maps each topic to one of them. They are defined, by what they
carry, in:
- `msgtypes`: the bounded field types every message is built of, the bounds, the `Message` base
  (strict, frozen, `extra="forbid"`, `schema_version`) and why every field is bounded;
- `msgnode`: a node about itself: availability, capabilities, profile request and report;
- `recipe`: the training recipe (`Recipe`, `LoraSpec` and the `LoraShape` a profile records) and a profile's key (`ProfileKey`);
- `msgjob`: a job's life: spec (a recipe plus the job's own fields), inspection, plan, assignment and ack, the controls (`JobControl`);
- `msgstate`: a running job's state: iteration metrics, a node's job status, the job state;
- `msgcatalog`: what an owner holds in its allowed directories (Home Assistant's job form);
- `msgrequest`: requests and answers: a node's `ErrorResponse`, the gateway's requests and response.
"""

from __future__ import annotations

from .msgtypes import (
    SCHEMA_VERSION, Task, Strategy, JobStrategy, DataFormat, GGUFType, Phase, MAX_INT, MAX_NODES, MAX_ID, MAX_TEXT, MAX_PATH,
    MAX_SECONDS, MAX_PERCENT, MAX_TIMESTAMP, MAX_BYTES, MAX_EVENTS, valid_text, Text, Int, Float,
    NonNegInt, PosInt, Count, NonNegFloat, Seconds, Timestamp, Bytes, ByteFloat, Rank, WorldSize, Ratio,
    Metric, Id, Name, Label, Host, PathText, Dim, Text256, Text4k, Event, Temperature, Layers, Threads,
    Heads, Vocab, Positions, Labels, Cores, BatchSize, SeqLen, UnitCount, Decay, LayerName, Column,
    LearningRate, Epochs, Steps, StepCount, Fraction, Megabytes, Seed, GradNorm, HostName, Eta, Percent,
    Code, TopicText, LoraRank, LoraAlpha, LoraTarget, Sample, Message,
)
from .msgnode import (
    Availability, ArchSpec, Capabilities, ProfileRequest, LayerProfile, CollectiveProfile, RowsProbe,
    ProfileSettings, ProfileReport,
)
from .msgjob import (
    JobSpec, PlanEntry, Plan, Assignment, AssignmentAck, JobStart, JobPause, JobResume, JobCancel,
    JobReshard, JobControl, JobControlAdapter, InspectRequest, InspectReport, SPEC_VERSION, mesh_of,
    MAX_CHUNKS, MAX_TRIAL_MODES, ModeForecast, Overlap, OverlapChoice, OverlapLabel, OverlapTrial, check_overlap_rows, check_trial,
    overlap_label,
)
from .recipe import LoraShape, LoraSpec, ProfileKey, Recipe
from .msgcatalog import (
    CATALOG_PATH_MAX, MAX_ALLOWED_DIRS, MAX_CATALOG_ENTRIES, CatalogPath, CatalogRequest, NodeCatalog,
)
from .msgstate import (
    IterationMetrics, NodeFloats, NodeBytes, JobState, NodeJobStatus,
)
from .msgrequest import (
    ErrorResponse, Transaction, GatewayRequest, JobSubmitRequest, JobStatusRequest, JobPauseRequest,
    JobResumeRequest, JobCancelRequest, NodesListRequest, PlanPreviewRequest, GatewayResponse,
    REQUEST_MODELS,
)

__all__ = [
    "SCHEMA_VERSION", "Task", "Strategy", "JobStrategy", "DataFormat", "GGUFType", "Phase", "MAX_INT", "MAX_NODES", "MAX_ID",
    "MAX_TEXT", "MAX_PATH", "MAX_SECONDS", "MAX_PERCENT", "MAX_TIMESTAMP", "MAX_BYTES", "MAX_EVENTS",
    "valid_text", "Text", "Int", "Float", "NonNegInt", "PosInt", "Count", "NonNegFloat", "Seconds",
    "Timestamp", "Bytes", "ByteFloat", "Rank", "WorldSize", "Ratio", "Metric", "Id", "Name", "Label",
    "Host", "PathText", "Dim", "Text256", "Text4k", "Event", "Temperature", "Layers", "Threads",
    "Heads", "Vocab", "Positions", "Labels", "Cores", "BatchSize", "SeqLen", "UnitCount", "Decay",
    "LayerName", "Column", "LearningRate", "Epochs", "Steps", "StepCount", "Fraction", "Megabytes",
    "Seed", "GradNorm", "HostName", "Eta", "Percent", "Code", "TopicText", "LoraRank", "LoraAlpha",
    "LoraTarget", "Sample", "Message", "Availability", "ArchSpec", "Capabilities", "ProfileRequest",
    "LayerProfile", "CollectiveProfile", "RowsProbe", "ProfileSettings", "ProfileReport", "JobSpec", "PlanEntry", "Plan", "Assignment",
    "AssignmentAck", "JobStart", "JobPause", "JobResume", "JobCancel", "JobReshard", "JobControl",
    "JobControlAdapter", "InspectRequest", "InspectReport", "SPEC_VERSION", "mesh_of", "MAX_CHUNKS", "MAX_TRIAL_MODES", "ModeForecast", "Overlap", "OverlapChoice", "OverlapLabel", "OverlapTrial", "check_overlap_rows", "check_trial", "overlap_label", "LoraShape", "LoraSpec", "ProfileKey", "Recipe", "IterationMetrics", "NodeFloats",
    "NodeBytes", "JobState", "NodeJobStatus", "ErrorResponse", "Transaction", "GatewayRequest",
    "JobSubmitRequest", "JobStatusRequest", "JobPauseRequest", "JobResumeRequest", "JobCancelRequest",
    "NodesListRequest", "PlanPreviewRequest", "GatewayResponse", "REQUEST_MODELS",
    "NodeCatalog", "CatalogRequest", "CATALOG_PATH_MAX", "MAX_CATALOG_ENTRIES",
    "MAX_ALLOWED_DIRS", "CatalogPath",
]
