"""Structural schemas of the custom resources deploy/k8s uses, written from the CRDs' documented fields
(KEDA keda.sh/v1alpha1 ScaledObject with a kafka trigger, Strimzi kafka.strimzi.io/v1beta2 KafkaTopic,
KafkaUser and KafkaMirrorMaker2, KEDA's TriggerAuthentication, prometheus-operator
monitoring.coreos.com/v1 PrometheusRule).

kubernetes-validate knows the built-in kinds only; these schemas check what each operator
requires and the types it accepts, with unknown fields refused so a misspelt key fails.
"""

from __future__ import annotations

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "namespace": {"type": "string"},
    },
}


def _resource(api: str, kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


KAFKA_TRIGGER_METADATA = {
    "type": "object",
    "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold"],
    "additionalProperties": False,
    "properties": {
        k: {"type": "string"}
        for k in (
            "bootstrapServers",
            "consumerGroup",
            "topic",
            "lagThreshold",
            "activationLagThreshold",
            "offsetResetPolicy",
            "allowIdleConsumers",
            "scaleToZeroOnInvalidOffset",
            "excludePersistentLag",
            "limitToPartitionsWithLag",
            "partitionLimitation",
            "version",
            "sasl",
            "tls",
        )
    },
}
_INT = {"type": "integer", "minimum": 0}
SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "additionalProperties": False,
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "kind": {"type": "string"},
                    "apiVersion": {"type": "string"},
                    "envSourceContainerName": {"type": "string"},
                },
            },
            "pollingInterval": _INT,
            "cooldownPeriod": _INT,
            "initialCooldownPeriod": _INT,
            "minReplicaCount": _INT,
            "maxReplicaCount": _INT,
            "idleReplicaCount": _INT,
            "advanced": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                    },
                },
            },
            "fallback": {"type": "object"},
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "additionalProperties": False,
                    "properties": {
                        "type": {"const": "kafka"},
                        "name": {"type": "string"},
                        "metadata": KAFKA_TRIGGER_METADATA,
                        "useCachedMetrics": {"type": "boolean"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "authenticationRef": {"type": "object"},
                    },
                },
            },
        },
    },
)
KAFKA_TOPIC = _resource(
    "kafka.strimzi.io/v1beta2",
    "KafkaTopic",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "partitions": {"type": "integer", "minimum": 1},
            "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
            "config": {"type": "object", "additionalProperties": {"type": ["string", "integer", "boolean"]}},
            "topicName": {"type": "string"},
        },
    },
)
KAFKA_USER = _resource(
    "kafka.strimzi.io/v1beta2",
    "KafkaUser",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "authentication": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": False,
                "properties": {
                    "type": {"enum": ["tls", "tls-external", "scram-sha-512"]},
                    "password": {"type": "object"},
                },
            },
            "authorization": {
                "type": "object",
                "required": ["type", "acls"],
                "additionalProperties": False,
                "properties": {
                    "type": {"const": "simple"},
                    "acls": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["resource", "operations"],
                            "additionalProperties": False,
                            "properties": {
                                "resource": {
                                    "type": "object",
                                    "required": ["type"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "type": {"enum": ["topic", "group", "cluster", "transactionalId"]},
                                        "name": {"type": "string"},
                                        "patternType": {"enum": ["literal", "prefix"]},
                                    },
                                },
                                "operations": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {
                                        "enum": [
                                            "Read",
                                            "Write",
                                            "Create",
                                            "Delete",
                                            "Alter",
                                            "Describe",
                                            "ClusterAction",
                                            "AlterConfigs",
                                            "DescribeConfigs",
                                            "IdempotentWrite",
                                            "All",
                                        ]
                                    },
                                },
                                "host": {"type": "string"},
                                "type": {"enum": ["allow", "deny"]},
                            },
                        },
                    },
                },
            },
            "quotas": {"type": "object"},
            "template": {"type": "object"},
        },
    },
)
_SCRAM = {
    "type": "object",
    "required": ["type", "username", "passwordSecret"],
    "additionalProperties": False,
    "properties": {
        "type": {"const": "scram-sha-512"},
        "username": {"type": "string"},
        "passwordSecret": {
            "type": "object",
            "required": ["secretName", "password"],
            "additionalProperties": False,
            "properties": {"secretName": {"type": "string"}, "password": {"type": "string"}},
        },
    },
}
_CONNECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "tasksMax": {"type": "integer", "minimum": 1},
        "config": {"type": "object", "additionalProperties": {"type": ["string", "integer", "boolean"]}},
    },
}
KAFKA_MIRROR_MAKER_2 = _resource(
    "kafka.strimzi.io/v1beta2",
    "KafkaMirrorMaker2",
    {
        "type": "object",
        "required": ["connectCluster", "clusters"],
        "additionalProperties": False,
        "properties": {
            "version": {"type": "string"},
            "replicas": {"type": "integer", "minimum": 0},
            "connectCluster": {"type": "string"},
            "clusters": {
                "type": "array",
                "minItems": 2,
                "items": {
                    "type": "object",
                    "required": ["alias", "bootstrapServers"],
                    "additionalProperties": False,
                    "properties": {
                        "alias": {"type": "string"},
                        "bootstrapServers": {"type": "string"},
                        "authentication": _SCRAM,
                        "tls": {"type": "object"},
                        "config": {
                            "type": "object",
                            "additionalProperties": {"type": ["string", "integer", "boolean"]},
                        },
                    },
                },
            },
            "mirrors": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["sourceCluster", "targetCluster"],
                    "additionalProperties": False,
                    "properties": {
                        "sourceCluster": {"type": "string"},
                        "targetCluster": {"type": "string"},
                        "sourceConnector": _CONNECTOR,
                        "checkpointConnector": _CONNECTOR,
                        "heartbeatConnector": _CONNECTOR,
                        "topicsPattern": {"type": "string"},
                        "topicsExcludePattern": {"type": "string"},
                        "groupsPattern": {"type": "string"},
                        "groupsExcludePattern": {"type": "string"},
                    },
                },
            },
            "resources": {"type": "object"},
            "template": {"type": "object"},
            "logging": {"type": "object"},
        },
    },
)
TRIGGER_AUTHENTICATION = _resource(
    "keda.sh/v1alpha1",
    "TriggerAuthentication",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["parameter", "name", "key"],
                    "additionalProperties": False,
                    "properties": {
                        "parameter": {"enum": ["sasl", "username", "password", "tls", "ca", "cert", "key"]},
                        "name": {"type": "string"},
                        "key": {"type": "string"},
                    },
                },
            },
            "env": {"type": "array"},
        },
    },
)
PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    {
        "type": "object",
        "required": ["groups"],
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string"},
                        "rules": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["alert", "expr"],
                                "additionalProperties": False,
                                "properties": {
                                    "alert": {"type": "string"},
                                    "expr": {"type": "string"},
                                    "for": {"type": "string", "pattern": r"^\d+[smhd]$"},
                                    "labels": _STRING_MAP,
                                    "annotations": _STRING_MAP,
                                },
                            },
                        },
                    },
                },
            }
        },
    },
)

SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"): KAFKA_TOPIC,
    ("kafka.strimzi.io/v1beta2", "KafkaUser"): KAFKA_USER,
    ("kafka.strimzi.io/v1beta2", "KafkaMirrorMaker2"): KAFKA_MIRROR_MAKER_2,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TRIGGER_AUTHENTICATION,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
}
