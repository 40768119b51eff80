from django.db import migrations, models

import jobs.base.validators


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0007_preemption"),
    ]

    operations = [
        migrations.AddField(
            model_name="host",
            name="swarm_state",
            field=models.CharField(
                blank=True,
                help_text="The engine's swarm state (active = a member).",
                max_length=12,
            ),
        ),
        migrations.AddField(
            model_name="host",
            name="swarm_cluster",
            field=models.CharField(
                blank=True,
                help_text="Members of one swarm share this (a manager's node ID).",
                max_length=64,
                verbose_name="swarm",
            ),
        ),
        migrations.AddField(
            model_name="host",
            name="swarm_manager",
            field=models.BooleanField(default=False),
        ),
        migrations.AlterField(
            model_name="host",
            name="address",
            field=models.CharField(
                help_text="The host's address on the hosts' network (its swarm address).",
                max_length=253,
                validators=[jobs.base.validators.validate_address],
            ),
        ),
    ]
