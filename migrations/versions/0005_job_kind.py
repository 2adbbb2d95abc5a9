"""ab_jobs.kind: A/B comparisons and tunings share the jobs table

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ab_jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="ab"))
        batch.create_index("ix_ab_jobs_kind_status", ["kind", "status"])


def downgrade() -> None:
    with op.batch_alter_table("ab_jobs") as batch:
        batch.drop_index("ix_ab_jobs_kind_status")
        batch.drop_column("kind")
