"""Register the third-party connector the way a project outside hicache-l3 would."""

from hicache_l3.common.registry import register_connector

register_connector("dirstore", "dirstore:DirConnector")
