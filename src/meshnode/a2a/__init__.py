"""The A2A bridge: hosted agents served to A2A v1.0 clients, with the AGBoss mesh extension."""
